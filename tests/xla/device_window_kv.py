"""Run as a script (a fresh process per tp: SPMD mode is per process), or call `main` in a process whose torch_xla
runs one device. Compiles a tiny sliding-window checkpoint with `--backend neuron` at the given tp, with the
window-sized KV geometry of tests/neuron_opt/test_window_kv.py (context 8x the window, blocks of 4, prefill chunks of
8), serves PROMPTS through the engine with prefix caching and chunked prefill on, and prints one JSON object: each
prompt's greedy tokens, the blocks of every layer's pool and the bytes the device holds for KV per rank. MODE
"preempt": a KV pool of one sequence's blocks, requests a step apart, so the scheduler preempts; "ngram": verify
graphs of 3 tokens and prompt-lookup speculative decoding (2 tokens a step).

    python device_window_kv.py CKPT OUT TP PROMPTS_JSON MAX_TOKENS EOS_JSON [MODE]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]  # the package before tests/ (whose neuron_opt/ folder would shadow it)

MAX_LEN, BS, CHUNK, BATCH = 48, 4, 8, 2


def main(ckpt: Path, out: Path, tp: int, prompts: list[list[int]], max_tokens: int, eos: list[int],
         mode: str = "plain") -> dict:
    from neuron_opt.backends.neuron.backend import import_xla

    import_xla(dump=True, devices=tp)
    from neuron_opt.compiler import CompileRequest, compile_artifact
    from neuron_opt.config import ParallelConfig
    from neuron_opt.executors import load_model
    from neuron_opt.runtime.block_manager import WindowedBlockManager
    from neuron_opt.runtime.engine import Engine
    from neuron_opt.runtime.sampling import SamplingParams
    from neuron_opt.runtime.speculative import SpeculativeConfig

    spec = SpeculativeConfig(num_speculative_tokens=2, adaptive=False) if mode == "ngram" else None
    compile_artifact(CompileRequest(model=str(ckpt), out=out, backend="neuron", dtype="float32", batch_size=BATCH,
                                    max_model_len=MAX_LEN, max_prompt_len=CHUNK, prefill_buckets=(CHUNK,),
                                    decode_buckets=(MAX_LEN,), block_size=BS, parallel=ParallelConfig(tp=tp),
                                    num_kv_blocks=MAX_LEN // BS + 1 if mode == "preempt" else 0,
                                    num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                                    use_cache=False),
                     log=lambda s: None, progress=False)
    loaded = load_model(out)
    runner = loaded.runner
    ranks = runner.executor.ranks
    caches = [*ranks.k_caches, *ranks.v_caches]
    engine = Engine(runner, loaded.tokenizer, tuple(eos), max_num_batched_tokens=CHUNK, enable_prefix_caching=True,
                    enable_chunked_prefill=True, speculative=spec)
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
    pending = list(range(len(prompts)))
    stagger = 1 if mode == "preempt" else 3  # the later requests find the first one's prefix, or preempt it
    for step in range(1000):
        while pending and step >= stagger * (len(prompts) - len(pending)):
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], params, lambda o, i=i: got[i].extend(o.new_token_ids))
        if not engine.step() and engine.num_unfinished == 0 and not pending:
            break
    blocks = engine.scheduler.blocks
    assert isinstance(blocks, WindowedBlockManager)
    return {
        "tokens": [got[i] for i in range(len(prompts))],
        "pool_blocks": [int(k.shape[-4]) for k in ranks.k_caches],  # [(tp,) blocks, n_kv, positions, D]
        "kv_bytes": sum(c.numel() * c.element_size() for c in caches) // tp,
        "prefix_hits": engine.prefix_cache_stats.hits,
        "prefills": engine.stats.prefills,
        "window_blocks_free": [blocks.window.num_free_blocks, blocks.window.num_blocks - 1],
        "buckets": sorted(b.key for b in runner.executor.buckets),
        "unfinished": engine.num_unfinished,
        "preemptions": engine.stats.preemptions,
        "accepted": engine.speculation.stats.accepted_tokens if engine.speculation else 0,
    }


if __name__ == "__main__":
    a = sys.argv[1:]
    print(json.dumps(main(Path(a[0]), Path(a[1]), int(a[2]), json.loads(a[3]), int(a[4]), json.loads(a[5]),
                          *a[6:7])))
