#!/usr/bin/env python
"""EAGLE-3 against plain decoding and prompt lookup, in one run: batch 1, greedy, the model run eagerly in float32,
on the open-ended chat prompts of neuron_opt/bench/spec_workloads.py (none of them among the trainer's seed
prompts). For each k of --ks: the mean accepted length (tokens per verify, the bonus token included), the
acceptance rate (accepted / proposed) and the time per output token (a request's wall time over its output
tokens, its prefill included; best of --repeats) of the head always verifying and under the adaptive controller,
and of prompt lookup under the adaptive controller; each mode's tokens compared with plain decoding's (fp32:
identical). The JSON records the machine and whether it was idle (neuron_opt.bench).

    python scripts/bench_eagle3.py --model default --head heads/default --ks 1 2 3 4 5 --out docs/bench/eagle3.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="a checkpoint (default: the embedded default model)")
    p.add_argument("--head", required=True, help="the EAGLE-3 head (scripts/train_eagle3.py --out, or a published one)")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="speculative tokens per step")
    p.add_argument("--max-tokens", type=int, default=128, help="answer length cap (answers end at EOS)")
    p.add_argument("--repeats", type=int, default=1, help="rounds per mode, the best kept (default 1)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--require-idle", action="store_true", help="refuse a busy machine")
    p.add_argument("--out", type=Path, required=True, help="the JSON")
    args = p.parse_args(argv)

    import torch

    from neuron_opt.api import LLM
    from neuron_opt.bench import RunRecord
    from neuron_opt.bench.spec_workloads import OPEN
    from neuron_opt.runtime.sampling import SamplingParams
    from neuron_opt.runtime.speculative import SpeculativeConfig

    torch.set_num_threads(args.threads)
    record = RunRecord(args.require_idle)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    results = []
    plain_tokens: list[list[int]] = []
    for k in args.ks:
        llm = LLM(args.model, batch_size=1, max_model_len=1024, num_speculative_tokens=k)
        prompts = [llm.encode_chat([{"role": "user", "content": t}]) for t in OPEN]
        modes = [("plain", None)] if not plain_tokens else []
        modes += [("ngram-adaptive", SpeculativeConfig(k)),
                  ("eagle3-always", SpeculativeConfig(k, "eagle3", adaptive=False, model=args.head)),
                  ("eagle3-adaptive", SpeculativeConfig(k, "eagle3", model=args.head))]
        for mode, spec in modes:
            best_s, tokens, drafts, proposed, accepted, verifies = float("inf"), [], 0, 0, 0, 0
            for _ in range(args.repeats):
                t0, outs = time.perf_counter(), []
                drafts = proposed = accepted = verifies = 0
                for ids in prompts:
                    if spec is None:
                        outs.append(llm.generate_ids(ids, params).token_ids)
                        continue
                    out, st = llm.generate_ids_speculative(ids, params, spec)
                    outs.append(out.token_ids)
                    drafts, proposed, accepted = drafts + st.drafts, proposed + st.draft_tokens, \
                        accepted + st.accepted_tokens
                    verifies += st.verify_steps
                best_s, tokens = min(best_s, time.perf_counter() - t0), outs
            if spec is None:
                plain_tokens = tokens
            n = sum(len(t) for t in tokens)
            row = {"k": k, "mode": mode, "output_tokens": n, "seconds": round(best_s, 3),
                   "tpot_ms": round(1e3 * best_s / n, 2), "outputs_equal_plain": tokens == plain_tokens,
                   "verify_steps": verifies,
                   "mean_accepted_length": round((accepted + drafts) / drafts, 3) if drafts else None,
                   "acceptance": round(accepted / proposed, 3) if proposed else None}
            results.append(row)
            print(json.dumps(row), flush=True)
    plain_ms = next(r["tpot_ms"] for r in results if r["mode"] == "plain")
    for r in results:
        r["speedup_vs_plain"] = round(plain_ms / r["tpot_ms"], 3)
    doc = {"benchmark": "eagle3", "model": args.model, "head": args.head, "dtype": "float32", "backend": "eager",
           "batch": 1, "prompts": OPEN, "max_tokens": args.max_tokens, "repeats": args.repeats,
           "threads": args.threads, **record.finish(), "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
