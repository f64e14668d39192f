"""neuron_opt: compile and serve Llama-family LLMs on AWS Neuron, with a real CPU path and an NKI simulator."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]


def __getattr__(name: str):  # lazy: importing neuron_opt must not import torch
    if name == "LLM":
        from neuron_opt.api import LLM

        return LLM
    if name == "LoRARequest":
        from neuron_opt.lora.registry import LoRARequest

        return LoRARequest
    if name == "SamplingParams":
        from neuron_opt.runtime.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
