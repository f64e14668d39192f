"""Run as a script (a fresh process per tp: SPMD mode is per process), or call `main` in a process whose torch_xla
runs one device. Compiles a tiny checkpoint with `--backend neuron` at the given tp with a pool of one sequence,
gives the engine a second KV tier over the device pools (`executor.tier_blocks()`), and serves a prompt, a filler
that takes every block of the pool (evicting the prompt's cached blocks into the tier) and the prompt again.
Prints one JSON object: both answers, the tier's counters and the prompt tokens each turn prefilled.

`window` (a sliding-window checkpoint, window-sized KV: the geometry of tests/xla/device_window_kv.py with a full
pool of one sequence): the tier's two groups over the device pools (`kv_tier.tier_pools`: the full layers' and the
window layers' copiers), a first turn, three other prompts that evict its blocks from both pools, and the second turn
(given: the first turn's prompt and HF's reply and more). MODE "corrupt-write": every block the tier writes back to
the device has its bytes replaced by noise first (so the test shows the restored blocks are read).

    python device_kv_tier.py CKPT OUT TP PROMPT_JSON MAX_TOKENS
    python device_kv_tier.py window CKPT OUT TP PROMPTS_JSON MAX_TOKENS EOS_JSON [MODE]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]  # the package before tests/ (whose neuron_opt/ folder would shadow it)

MAX_LEN, BS = 32, 4


def main(ckpt: Path, out: Path, tp: int, prompt: list[int], max_tokens: int) -> dict:
    from neuron_opt.backends.neuron.backend import import_xla

    import_xla(dump=True, devices=tp)
    from neuron_opt.compiler import CompileRequest, compile_artifact
    from neuron_opt.config import ParallelConfig
    from neuron_opt.executors import load_model
    from neuron_opt.runtime.engine import Engine
    from neuron_opt.runtime.kv_tier import KVTier, executor_blocks
    from neuron_opt.runtime.sampling import SamplingParams

    compile_artifact(CompileRequest(model=str(ckpt), out=out, backend="neuron", dtype="float32", batch_size=1,
                                    max_model_len=MAX_LEN, max_prompt_len=16, prefill_buckets=(16,),
                                    decode_buckets=(MAX_LEN,), block_size=BS, parallel=ParallelConfig(tp=tp),
                                    use_cache=False),
                     log=lambda s: None, progress=False)
    loaded = load_model(out)
    runner = loaded.runner
    pools = executor_blocks(runner.executor)
    tier = KVTier(pools, 16 * pools.block_bytes)
    engine = Engine(runner, loaded.tokenizer, (), max_num_batched_tokens=16, enable_prefix_caching=True,
                    enable_chunked_prefill=True, kv_tier=tier)
    usable = runner.cache.num_blocks - 1
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)

    def serve(rid: str, ids: list[int], n: int = max_tokens) -> tuple[list[int], int]:
        got: list[int] = []
        before = engine.stats.prefill_tokens
        engine.add_request(rid, ids, SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0),
                           lambda o: got.extend(o.new_token_ids))
        while engine.step() or engine.num_unfinished:
            pass
        return got, engine.stats.prefill_tokens - before

    assert params.max_tokens == max_tokens
    first, first_prefilled = serve("first", prompt)
    filler = [3 + (i % 50) for i in range(usable * BS - 1)]  # every block of the pool
    serve("filler", filler, 1)
    evicted = engine.scheduler.blocks.cached_prefix(prompt) == []
    again, again_prefilled = serve("again", prompt)
    st = tier.stats
    return {"first": first, "again": again, "first_prefilled": first_prefilled, "again_prefilled": again_prefilled,
            "evicted": evicted, "stored": st.stored, "restored": st.restored_ram, "hits": st.hits,
            "corrupt": st.corrupt, "block_bytes": pools.block_bytes,
            "pool_bytes": sum(c.numel() * c.element_size() for c in [*runner.executor.k_caches,
                                                                      *runner.executor.v_caches]),
            "num_blocks": runner.cache.num_blocks}


def main_window(ckpt: Path, out: Path, tp: int, prompts: list[list[int]], max_tokens: int, eos: list[int],
                mode: str = "plain") -> dict:
    """`prompts`: the first turn and the second (which starts with the first turn's prompt and reply)."""
    from neuron_opt.backends.neuron.backend import import_xla

    import_xla(dump=True, devices=tp)
    import torch
    import torch_xla.debug.metrics as met

    from neuron_opt.compiler import CompileRequest, compile_artifact
    from neuron_opt.config import ParallelConfig
    from neuron_opt.executors import load_model
    from neuron_opt.runtime.block_manager import WindowedBlockManager
    from neuron_opt.runtime.engine import Engine
    from neuron_opt.runtime.kv_tier import KVTier, tier_pools
    from neuron_opt.runtime.sampling import SamplingParams

    max_len, chunk = 48, 8
    compile_artifact(CompileRequest(model=str(ckpt), out=out, backend="neuron", dtype="float32", batch_size=1,
                                    max_model_len=max_len, max_prompt_len=chunk, prefill_buckets=(chunk,),
                                    decode_buckets=(max_len,), block_size=BS, parallel=ParallelConfig(tp=tp),
                                    num_kv_blocks=max_len // BS + 1, use_cache=False),
                     log=lambda s: None, progress=False)
    loaded = load_model(out)
    runner = loaded.runner
    full, window = tier_pools(runner.executor, loaded.model_config, runner.cache)
    assert window is not None
    noise = torch.Generator().manual_seed(0)
    copier_compiles = [0]  # graphs XLA compiled inside the copier's reads and writes

    def compiled() -> int:  # (its CompileTime metric also counts SPMD executions)
        return met.counter_value("UncachedCompile") or 0

    for pools in (full, window):
        read, write = pools.read, pools.write

        def counted_read(block: int, read=read) -> torch.Tensor:
            before = compiled()
            data = read(block)
            copier_compiles[0] += compiled() - before
            return data

        def counted_write(block: int, data: torch.Tensor, write=write) -> None:
            if mode == "corrupt-write":
                data = torch.randint(0, 256, data.shape, dtype=torch.uint8, generator=noise)
            before = compiled()
            write(block, data)
            copier_compiles[0] += compiled() - before

        pools.read, pools.write = counted_read, counted_write  # type: ignore[method-assign]
    tier = KVTier(full, 64 * full.block_bytes, window_pools=window)
    engine = Engine(runner, loaded.tokenizer, tuple(eos), max_num_batched_tokens=chunk, enable_prefix_caching=True,
                    enable_chunked_prefill=True, kv_tier=tier)
    blocks = engine.scheduler.blocks
    assert isinstance(blocks, WindowedBlockManager)

    def serve(rid: str, ids: list[int]) -> tuple[list[int], int]:
        got: list[int] = []
        before = engine.stats.prefill_tokens
        engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0),
                           lambda o: got.extend(o.new_token_ids))
        while engine.step() or engine.num_unfinished:
            pass
        return got, engine.stats.prefill_tokens - before

    first, first_prefilled = serve("first", prompts[0])
    g = torch.Generator().manual_seed(9)
    for i in range(3):  # evict the first turn's blocks from both pools
        serve(f"other{i}", torch.randint(3, loaded.model_config.vocab_size, (20,), generator=g).tolist())
    turn2 = prompts[1]
    kept = (len(prompts[0]) + max_tokens - 1) // BS  # the first turn's blocks with K/V
    seen = blocks.first_visible_block(kept * BS)  # the window blocks the second turn's next query sees
    evicted = blocks.cached_prefix(turn2) == []
    again, again_prefilled = serve("again", turn2)
    st = tier.stats
    caches = [*runner.executor.k_caches, *runner.executor.v_caches]
    return {"first": first, "again": again, "first_prefilled": first_prefilled, "again_prefilled": again_prefilled,
            "evicted": evicted, "kept": kept, "seen": seen, "stored": st.stored, "restored": st.restored_ram,
            "hits": st.hits, "corrupt": st.corrupt,
            "block_bytes": [full.block_bytes, window.block_bytes],
            "num_blocks": [runner.cache.num_blocks, runner.cache.window_num_blocks],
            "pool_bytes": sum(c.numel() * c.element_size() for c in caches),
            "copier_graphs": copier_compiles[0]}


if __name__ == "__main__":
    a = sys.argv[1:]
    if a[0] == "window":
        print(json.dumps(main_window(Path(a[1]), Path(a[2]), int(a[3]), json.loads(a[4]), int(a[5]),
                                     json.loads(a[6]), *a[7:8])))
    else:
        print(json.dumps(main(Path(a[0]), Path(a[1]), int(a[2]), json.loads(a[3]), int(a[4]))))
