"""Run as a script (a fresh process per tp: SPMD mode is per process), or call `main` in a process whose torch_xla
runs one device. Compiles a tiny checkpoint with `--backend neuron` at the given tp with a pool of one sequence,
gives the engine a second KV tier over the device pools (`executor.tier_blocks()`), and serves a prompt, a filler
that takes every block of the pool (evicting the prompt's cached blocks into the tier) and the prompt again.
Prints one JSON object: both answers, the tier's counters and the prompt tokens each turn prefilled.

    python device_kv_tier.py CKPT OUT TP PROMPT_JSON MAX_TOKENS
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


if __name__ == "__main__":
    a = sys.argv[1:]
    print(json.dumps(main(Path(a[0]), Path(a[1]), int(a[2]), json.loads(a[3]), int(a[4]))))
