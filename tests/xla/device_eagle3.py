"""Run as a script (a fresh process per tp: SPMD mode is per process). Compiles a tiny checkpoint with `--backend
neuron` and verify graphs at the given tp, runs a mixed batch through the engine without speculation, then with an
EAGLE-3 head (its chain as device graphs; always verifying), recording every call of the device chain; replays
those calls through the head in torch on the host (runtime/eagle3.EagerChain, its own block pools) and prints one
JSON object: each request's tokens both ways, the device chain's and the host chain's proposals per call, the graph
calls the device chain made, the verify steps, each bucket's graph outputs, whether a second engine reuses the
device chain; and how far the auxiliary states of a prefill and of a verify
step are from the eager model's.

    python device_eagle3.py CKPT HEAD OUT TP
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]  # the package before tests/ (whose neuron_opt/ folder would shadow it)

K = 3
# a speculating row, a row that never speculates (max_tokens 2: no budget for a proposal at any step), and a
# third that joins when that one finishes (two sequences at a time); the first two prompts share their start
PROMPTS = [[(7 * i + 3) % 200 + 3 for i in range(12)], [(7 * i + 3) % 200 + 3 for i in range(9)] + [40, 41],
           [(5 * i + 4) % 200 + 3 for i in range(20)]]
MAX_TOKENS = [30, 2, 24]


def main(ckpt: Path, head_dir: Path, out: Path, tp: int) -> dict:
    from neuron_opt.backends.neuron.backend import import_xla

    import_xla(dump=True, devices=tp)
    import torch

    from neuron_opt.api import LLM
    from neuron_opt.compiler import CompileRequest, compile_artifact
    from neuron_opt.config import ParallelConfig
    from neuron_opt.runtime.eagle3 import EagerChain
    from neuron_opt.runtime.engine import Engine
    from neuron_opt.runtime.runner import VerifyRow
    from neuron_opt.runtime.sampling import SamplingParams
    from neuron_opt.runtime.speculative import SpeculativeConfig

    compile_artifact(CompileRequest(model=str(ckpt), out=out, backend="neuron", dtype="float32", max_model_len=64,
                                    prefill_buckets=(32,), decode_buckets=(32, 64), batch_size=2,
                                    offset_prefill=False, num_speculative_tokens=K, parallel=ParallelConfig(tp=tp),
                                    use_cache=False),
                     log=lambda s: None, progress=False)
    llm = LLM(out)

    def run(engine: Engine) -> dict[str, list[int]]:
        outs: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
        for i, ids in enumerate(PROMPTS):
            engine.add_request(str(i), ids, SamplingParams(max_tokens=MAX_TOKENS[i], ignore_eos=True),
                               lambda o, i=i: outs[str(i)].extend(o.new_token_ids))
        for _ in range(200):
            if not engine.step() and engine.num_unfinished == 0:
                break
        return outs

    plain = run(Engine(llm.runner, llm.tokenizer, llm.eos_token_ids))
    spec = SpeculativeConfig(K, "eagle3", adaptive=False, model=str(head_dir))
    head = llm.eagle3(head_dir)
    engine = Engine(llm.runner, llm.tokenizer, llm.eos_token_ids, speculative=spec, draft=head)
    chain = engine.proposer.chain
    calls = []
    inner = chain.propose

    def recording(rows):  # what the engine asked of the device chain and what it answered
        got = inner(rows)
        calls.append((list(rows), got))
        return got

    chain.propose = recording
    speculative = run(engine)
    host = EagerChain(head, llm.runner.cache)  # the same calls, in order, through the head on the host
    with torch.inference_mode():
        replayed = [host.propose(rows) for rows, _ in calls]
    # the states themselves, against the eager model's (`forward_with_aux`): a prefill, then a verify after it
    eager = LLM(str(ckpt), max_model_len=64, num_speculative_tokens=K)
    eager.runner.capture_aux_hidden(head.aux_layer_ids)
    diffs = []
    for runner in (llm.runner, eager.runner):
        runner.prefill(0, PROMPTS[2])
        diffs.append([runner.aux_hidden[0, :len(PROMPTS[2])]])
        runner.verify([VerifyRow(0, (9, 8, 7, 6), len(PROMPTS[2]))])
        diffs[-1].append(runner.aux_hidden[0])
    aux_diff = [float((a - b).abs().max()) for a, b in zip(*diffs, strict=True)]
    # a later engine (a later LLM call) reuses the head's device copy and graphs
    again = Engine(llm.runner, llm.tokenizer, llm.eos_token_ids, speculative=spec, draft=head)
    return {"plain": plain, "aux_diff": aux_diff, "speculative": speculative, "chain": type(chain).__name__,
            "device": [got for _, got in calls], "host": replayed,
            "behind": sum(len(r.tokens) > K + 1 for rows, _ in calls for r in rows),
            "graph_calls": chain.calls, "verify_steps": engine.spec_stats.verify_steps,
            # each bucket's graph outputs before the KV caches (replayed at tp 1; None: traced, tp 2)
            "outputs": {b.key: r.outputs if r else None for b, r in llm.runner.executor.buckets.items()},
            "reused": again.proposer.chain is chain}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))))
