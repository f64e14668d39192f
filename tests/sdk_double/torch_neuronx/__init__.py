"""TEST DOUBLE of the documented `torch_neuronx` inference API. This is NOT the AWS Neuron SDK.

It exists only to exercise our adapter (`neuron_opt/backends/neuron.py`) on a CPU machine: the signatures are
the documented ones, the semantics are CPU stand-ins, and every call is recorded in `CALLS` so that tests can
check what the adapter asked for. Passing tests against this double say nothing about neuronx-cc or the Neuron
runtime.

Documented API mirrored here:
- `trace(func, example_inputs, *_, input_output_aliases={}, compiler_workdir=None, compiler_args=None,
  partitioner_config=None, inline_weights_to_neff=True, cpu_backend=False)` returns a TorchScript module that
  `torch.jit.save` / `torch.jit.load` round-trip. Double: `torch.jit.trace` on CPU.
  https://awsdocs-neuron.readthedocs-hosted.com/en/latest/frameworks/torch/torch-neuronx/api-reference-guide/inference/api-torch-neuronx-trace.html
- `replace_weights(neuron_model, weights)`: `weights` is a module or a state dict; in place; only for models
  traced with `inline_weights_to_neff=False`, warns otherwise. Double: copies tensors by name.
  https://awsdocs-neuron.readthedocs-hosted.com/en/latest/frameworks/torch/torch-neuronx/api-reference-guide/inference/api-torch-neuronx-replace-weights.html
- `move_trace_to_device(trace, device_id)`: in place, returns None. Double: records the call.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

CALLS: list[dict[str, Any]] = []  # one entry per call: {"fn": name, ...arguments}
# The SDK knows whether a loaded model has separated weights; the double can't mark a ScriptModule that
# survives save/load, so it remembers the ids of the modules it traced inline.
_INLINE_TRACED: set[int] = set()


def _describe(t: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    return tuple(t.shape), t.dtype


def trace(
    func: Any,
    example_inputs: Any,
    *_: Any,
    input_output_aliases: dict | None = None,
    compiler_workdir: str | None = None,
    compiler_args: str | list[str] | None = None,
    partitioner_config: Any = None,
    inline_weights_to_neff: bool = True,
    cpu_backend: bool = False,
) -> torch.jit.ScriptModule:
    if _:
        # the SDK (>= 2.15) warns and guesses; the double refuses so that positional misuse fails the tests
        raise TypeError("torch_neuronx.trace: pass keyword arguments as keywords")
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    CALLS.append(
        dict(
            fn="trace",
            inputs=[_describe(t) for t in inputs],
            input_output_aliases=dict(input_output_aliases or {}),
            compiler_workdir=compiler_workdir,
            compiler_args=compiler_args,
            inline_weights_to_neff=inline_weights_to_neff,
            cpu_backend=cpu_backend,
        )
    )
    traced = torch.jit.trace(func, inputs, check_trace=False)
    if inline_weights_to_neff:
        _INLINE_TRACED.add(id(traced))
    return traced


def replace_weights(
    neuron_model: torch.jit.ScriptModule, weights: torch.nn.Module | dict[str, torch.Tensor]
) -> None:
    if id(neuron_model) in _INLINE_TRACED:
        warnings.warn("replace_weights: this model has no separated weights", stacklevel=2)
    sd = weights.state_dict() if isinstance(weights, torch.nn.Module) else dict(weights)
    own = dict(neuron_model.named_parameters())
    own.update(dict(neuron_model.named_buffers()))
    replaced = []
    for name, value in sd.items():
        if name in own:
            if own[name].shape != value.shape:
                raise ValueError(
                    f"replace_weights: {name} has shape {tuple(value.shape)}, "
                    f"the traced model expects {tuple(own[name].shape)}"
                )
            with torch.no_grad():
                own[name].copy_(value)
            replaced.append(name)
    if not replaced:
        raise KeyError("replace_weights: none of the given names is a weight of the traced model")
    CALLS.append(dict(fn="replace_weights", names=sorted(replaced)))


def move_trace_to_device(trace: torch.jit.ScriptModule, device_id: int) -> None:
    CALLS.append(dict(fn="move_trace_to_device", device_id=device_id))
