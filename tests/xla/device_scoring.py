"""Run as a script (a fresh process per tp: SPMD mode is per process). Compiles a tiny checkpoint with
`--backend neuron` at the given tp, then runs two prompts through the engine with prompt logprobs (on their
prefill buckets' every-position graphs, compiled on demand) and again without, and prints
one JSON object: per prompt its ids, each scored position's [token id, logprob, likeliest id] and the greedy
tokens with and without scoring; and the buckets whose every-position graph was compiled.

    python device_scoring.py CKPT OUT TP
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]  # the package before tests/ (whose neuron_opt/ folder would shadow it)

PROMPTS = [[(7 * i + 3) % 200 + 3 for i in range(12)], [(5 * i + 4) % 200 + 3 for i in range(20)]]


def main(ckpt: Path, out: Path, tp: int) -> dict:
    from neuron_opt.backends.neuron.backend import import_xla

    import_xla(dump=True, devices=tp)
    from neuron_opt.api import LLM
    from neuron_opt.compiler import CompileRequest, compile_artifact
    from neuron_opt.config import ParallelConfig
    from neuron_opt.runtime.engine import Engine
    from neuron_opt.runtime.sampling import SamplingParams

    compile_artifact(CompileRequest(model=str(ckpt), out=out, backend="neuron", dtype="float32", max_model_len=32,
                                    prefill_buckets=(16, 32), decode_buckets=(16, 32), batch_size=2,
                                    parallel=ParallelConfig(tp=tp), use_cache=False),
                     log=lambda s: None, progress=False)
    llm = LLM(out)
    engine = Engine(llm.runner, llm.tokenizer, llm.eos_token_ids)

    def run(params: SamplingParams) -> list[list]:
        outs: dict[str, list] = {str(i): [] for i in range(len(PROMPTS))}
        for i, ids in enumerate(PROMPTS):
            engine.add_request(f"{params.prompt_logprobs}-{i}", ids, params, outs[str(i)].append)
        for _ in range(50):
            if not engine.step() and engine.num_unfinished == 0:
                break
        return outs

    scored = run(SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=1))
    plain = run(SamplingParams(max_tokens=4, ignore_eos=True))
    prompts = []
    for i, ids in enumerate(PROMPTS):
        lps = scored[str(i)][0].prompt_logprobs
        prompts.append({
            "ids": ids,
            "first": lps[0],
            "scored": [[lp.token_id, lp.logprob, lp.top[0][0]] for lp in lps[1:]],
            "tokens": [t for o in scored[str(i)] for t in o.new_token_ids],
            "plain_tokens": [t for o in plain[str(i)] for t in o.new_token_ids],
        })
    return {"prompts": prompts, "every": sorted(b.key for b in llm.runner.executor.every)}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))))
