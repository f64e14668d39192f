"""The body of one rank process: join the gloo group, load this rank's weights, serve steps from the driver.

Protocol over the rank's pipe (driver -> rank, then one reply rank -> driver):
  ("run", bucket, arrays, candidates, lora slots, images)
                                       -> ("ok", result)   rank 0's result is the finished logits, others None
                                                        (images: a step's image embeddings, M-RoPE positions
                                                        and last keys, image_arrays, or None)
  ("calls",)                           -> ("ok", [CollectiveCall, ...]) counted since the last reset
  ("reset",)                           -> ("ok", None)
  ("lora", slot, adapter | None)       -> ("ok", None)   this rank's shard of the adapter written into the slot
                                                        (None: the slot cleared)
  ("aux", layer_ids)                   -> ("ok", None)   from now on rank 0's "run" result is (logits, the
                                                        residual stream entering these layers, [B, S, n * H]:
                                                        every rank holds it whole), for an EAGLE-3 head
  ("embed", ids)                       -> ("ok", rows)   rank 0: the token embedding rows of ids (vocab-parallel:
                                                        every rank takes part), unscaled
  ("stop",)                            -> ("ok", None), then the rank leaves the group and exits
Any exception -> ("error", traceback text), and the rank exits with code 1. A closed pipe (driver gone) ends
the loop. Collectives time out after `collective_timeout_s`, so a peer that dies mid-step cannot hang a rank.
"""

from __future__ import annotations

import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from models.build import apply_lora_capacity, apply_quant_layout, model_class
from neuron_opt.backends.base import StepInputs, allocate_kv
from neuron_opt.executors.launcher import RankSpec
from neuron_opt.lora.adapter import load_into_slot
from neuron_opt.lora.ops import LoraInputs, stacks_for
from neuron_opt.parallel.collectives import TorchCollectives
from neuron_opt.parallel.context import Collectives, ParallelContext
from neuron_opt.parallel.vocab import gather_candidates, gather_full, mask_padded_vocab
from neuron_opt.weights import load_model_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _join_group(rank: int, tp: int, port: int, spec: RankSpec) -> TorchCollectives:
    """Join the tp group (and flash decoding's KV subgroup)."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=tp,
        timeout=timedelta(seconds=spec.collective_timeout_s),
    )
    g = spec.layout.kv_seq_shards
    mine, size = None, 1
    if g > 1:
        for first in range(0, tp, g):  # every rank creates every subgroup, in the same order
            grp = dist.new_group(list(range(first, first + g)))
            if first <= rank < first + g:
                mine, size = grp, g
    return TorchCollectives(tp, mine, size)


def _build(rank: int, spec: RankSpec, comm: Collectives) -> Any:
    par = spec.parallel
    pctx = ParallelContext(par.tp, rank, comm, sequence_parallel=par.sequence_parallel)
    model = model_class(spec.model)(spec.model, spec.layout, spec.cache.max_model_len, pctx)
    apply_quant_layout(model, spec.quant)
    apply_lora_capacity(model, spec.lora)
    load_model_weights(model, Path(spec.weights_dir) / f"rank{rank}.safetensors")
    return model.to(DTYPES[spec.dtype]).eval()


def _finish(
    local: torch.Tensor, rank: int, spec: RankSpec, comm: TorchCollectives, candidates: int | None
) -> Any:
    """This rank's logits [rows, V/tp] (a verify step's [B, q, V/tp] flattened to B * q rows) -> rank 0's
    gathered logits or candidates. An embedding model's output is the whole pooled [B, H] on every rank: rank 0's
    is sent as it is."""
    if spec.model.is_embedding:
        return local.numpy() if rank == 0 else None
    local = mask_padded_vocab(local.reshape(-1, local.shape[-1]), rank, spec.model.vocab_size)
    if candidates is None:
        full = gather_full(local, comm)
        return full[:, : spec.model.vocab_size].numpy() if rank == 0 else None
    vals, ids = gather_candidates(local, rank, candidates, comm)
    return (vals.numpy(), ids.numpy()) if rank == 0 else None


def rank_main(rank: int, port: int, spec: RankSpec, conn: Connection) -> None:
    """Entry point of a spawned rank process."""
    torch.set_num_threads(spec.threads_per_rank)
    try:
        comm = _join_group(rank, spec.parallel.tp, port, spec)
        model = _build(rank, spec, comm)
        k_caches, v_caches = allocate_kv(model, spec.cache, DTYPES[spec.dtype])
        stacks = stacks_for(model, DTYPES[spec.dtype])
        aux_layers: tuple[int, ...] = ()
        conn.send(("ok", "ready"))
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the driver is gone
                break
            if msg[0] == "run":
                _, bucket, arrays, candidates = msg[:4]
                slots = msg[4] if len(msg) > 4 else None
                tensors = [torch.from_numpy(a) for a in arrays]  # the five arrays, then window-sized KV's two
                inputs = StepInputs(*tensors[:5], None, *tensors[5:])
                window = {"window_kv": inputs.window_kv()} if inputs.window_kv() is not None else {}
                lora = None if stacks is None or slots is None else LoraInputs(stacks, torch.from_numpy(slots))
                kw: dict[str, Any] = dict(window)
                kw.update(_image_inputs(msg[5] if len(msg) > 5 else None))
                if lora is not None:
                    kw["lora"] = lora
                with torch.inference_mode():
                    if aux_layers:
                        local, aux = model.forward_with_aux(*inputs.arrays(), k_caches, v_caches, bucket.kv_len,
                                                            aux_layers, bucket.generates, **kw)
                        done = _finish(local.float(), rank, spec, comm, candidates)
                        conn.send(("ok", (done, aux.float().numpy()) if rank == 0 else None))
                    else:
                        local = model(*inputs.arrays(), k_caches, v_caches, bucket.kv_len, bucket.generates, **kw)
                        conn.send(("ok", _finish(local.float(), rank, spec, comm, candidates)))
            elif msg[0] == "aux":
                aux_layers = tuple(msg[1])
                conn.send(("ok", None))
            elif msg[0] == "embed":
                with torch.inference_mode():
                    rows = model.model.embed_tokens(torch.from_numpy(msg[1]))
                conn.send(("ok", rows.float().numpy() if rank == 0 else None))
            elif msg[0] == "lora":
                _, slot, adapter = msg
                if adapter is None:
                    stacks.clear_slot(slot)
                else:
                    load_into_slot(stacks, slot, adapter, model)
                conn.send(("ok", None))
            elif msg[0] == "calls":
                conn.send(("ok", list(comm.counter.calls)))
            elif msg[0] == "reset":
                comm.counter.calls.clear()
                conn.send(("ok", None))
            elif msg[0] == "stop":
                conn.send(("ok", None))
                break
            else:
                raise ValueError(f"rank {rank}: unknown message {msg[0]!r}")
    except Exception:
        try:
            conn.send(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        finally:
            raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def image_arrays(inputs: StepInputs) -> dict[str, np.ndarray] | None:
    """A step's image embeddings (mask, rows: fp32, numpy has no bf16), M-RoPE positions and bidirectional blocks'
    last keys (StepInputs.last_keys) for the pipe; None without any."""
    out = {}
    if inputs.multimodal() is not None:
        mask, rows = inputs.multimodal()  # type: ignore[misc]
        out.update(mm_mask=mask.contiguous().numpy(), mm_embeds=rows.float().contiguous().numpy())
    if inputs.rope_positions is not None:
        out["rope_positions"] = inputs.rope_positions.contiguous().numpy()
    if inputs.last_keys is not None:
        out["last_keys"] = inputs.last_keys.contiguous().numpy()
    return out or None


def _image_inputs(arrays: dict[str, np.ndarray] | None) -> dict[str, Any]:
    """`image_arrays` as the model's keyword arguments (mm_embeds: the model merges them in its own dtype)."""
    if not arrays:
        return {}
    kw: dict[str, Any] = {}
    if "mm_mask" in arrays:
        kw["mm_embeds"] = (torch.from_numpy(arrays["mm_mask"]), torch.from_numpy(arrays["mm_embeds"]))
    if "rope_positions" in arrays:
        kw["rope_positions"] = torch.from_numpy(arrays["rope_positions"])
    if "last_keys" in arrays:
        kw["last_keys"] = torch.from_numpy(arrays["last_keys"])
    return kw


def step_arrays(inputs: StepInputs) -> tuple[np.ndarray, ...]:
    """StepInputs -> numpy arrays for the pipe (plain arrays pickle without torch's shared-memory handles)."""
    window = inputs.window_kv() or ()
    return tuple(t.contiguous().numpy() for t in (*inputs.arrays(), *window))
