"""Run as a script (a fresh process per tp: SPMD mode is per process). Compiles a tiny checkpoint with
`--backend neuron` at the given tp, then runs four rows of different sampling parameters (greedy; temperature;
top-k with presence/frequency penalties and logprobs; top-p, min-p and a logit bias) through a prefill and decode
steps twice: the graphs sampling on the device (`decode_sampled`), and the host sampler on the same step's logits
with a copy of each request's seeded generator. Prints one JSON object: both token streams, the largest logprob
difference, the bytes each kind of decode step moved device -> host, and verify steps of the same rows accepted in
the graph beside the host verifier's acceptance (`verify_streams`).

    python device_sampling.py CKPT OUT TP
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]  # the package before tests/ (whose neuron_opt/ folder would shadow it)

PARAMS = [dict(),  # greedy
          dict(temperature=0.9, seed=1),
          dict(temperature=1.3, top_k=5, seed=2, presence_penalty=0.5, frequency_penalty=0.7, logprobs=3),
          dict(temperature=0.8, top_k=40, top_p=0.8, min_p=0.05, seed=3, logit_bias=((7, 1.5), (9, -3.0)),
               logprobs=0)]


def streams(runner, steps: int, tp: int) -> dict:
    from neuron_opt.runtime.runner import DecodeRow, PrefillRow
    from neuron_opt.runtime.sampling import (
        SamplerState,
        SamplingParams,
        device_inputs,
        device_results,
        host_sampling_reason,
        sample_batch,
    )

    V = runner.vocab_size
    params = [SamplingParams(max_tokens=64, **p) for p in PARAMS]
    if tp > 1:  # the vocab-parallel path samples from the ranks' candidates: rows with a top_k within them
        params[1] = SamplingParams(max_tokens=64, temperature=0.9, top_k=50, seed=1)
    host = [SamplerState.create(p) for p in params]
    dev = [SamplerState.create(p) for p in params]
    assert all(host_sampling_reason(st, runner.sample_candidates) is None for st in dev)
    prompts = [[(7 * i + 3 * r) % 200 + 3 for i in range(5 + 2 * r)] for r in range(len(params))]
    blocks = [[1 + r] for r in range(len(params))]
    ban = [()] * len(params)
    rows = [PrefillRow(b, tuple(p)) for b, p in zip(blocks, prompts, strict=True)]
    out = {"host": [[] for _ in params], "device": [[] for _ in params], "lp_diff": 0.0, "d2h": {}}

    def step(logits, outs):
        h = sample_batch(logits, host, ban)
        d = device_results(outs[0].tolist(), tuple(outs[1:]) or None, dev)
        for r in range(len(params)):
            out["host"][r].append(h[r].token)
            out["device"][r].append(d[r].token)
            if h[r].logprob is not None:
                diffs = [abs(h[r].logprob - d[r].logprob)]
                diffs += [abs(a[1] - b[1]) for a, b in zip(h[r].top_logprobs, d[r].top_logprobs, strict=True)]
                assert [a[0] for a in h[r].top_logprobs] == [b[0] for b in d[r].top_logprobs]
                out["lp_diff"] = max(out["lp_diff"], *diffs)
            host[r].observe(h[r].token)
            dev[r].observe(d[r].token)
        return [x.token for x in h]

    logits = runner.prefill_rows(rows)
    toks = step(logits, runner.prefill_sampled(rows, device_inputs(dev, ban, V)))
    pos = [len(p) for p in prompts]
    for _ in range(steps):
        drows = [DecodeRow(b, t, p) for b, t, p in zip(blocks, toks, pos, strict=True)]
        logits = runner.decode(drows)
        out["d2h"]["logits"] = runner.stats.last_d2h_bytes
        outs = runner.decode_sampled(drows, device_inputs(dev, ban, V))
        out["d2h"]["sampled" if len(outs) == 1 else "sampled_logprobs"] = runner.stats.last_d2h_bytes
        toks = step(logits, outs)
        pos = [p + 1 for p in pos]
    out["batch"] = runner.last_bucket.batch
    if runner.verify_len:
        out["verify"] = verify_streams(runner, host, dev, blocks, toks, pos, steps=3)  # within max_model_len 32
    return out


def verify_streams(runner, host: list, dev: list, blocks: list, toks: list[int], pos: list[int], steps: int) -> dict:
    """`steps` verify steps of every row, each proposing first the target's argmax after its last token, then a
    token the target rarely takes (rows 1 and 3 propose one token, so some steps take a bonus): accepted in the graph
    (`verify_sampled` + `accept_device`) and by the host verifier (`accept` on the same step's logits), the host's
    tokens fed on. Returns both token streams, the accepted proposal counts, the largest logprob difference, and
    whether the generators ended in the same state."""
    from neuron_opt.runtime.runner import VerifyRow
    from neuron_opt.runtime.sampling import verify_host_reason, verify_inputs
    from neuron_opt.runtime.speculative import accept, accept_device

    q, V = runner.verify_len, runner.vocab_size
    res = {"host": [[] for _ in host], "device": [[] for _ in host], "accepted": [0, 0], "lp_diff": 0.0}
    for _ in range(steps):
        first = runner.verify([VerifyRow(b, (t,), p) for b, t, p in zip(blocks, toks, pos, strict=True)])[:, 0]
        drafts = [[int(first[r].argmax()), (toks[r] * 7) % 200 + 3][: q - 1 - r % 2] for r in range(len(host))]
        vrows = [VerifyRow(b, (t, *d), p) for b, t, d, p in zip(blocks, toks, drafts, pos, strict=True)]
        ban = [[()] * (len(d) + 1) for d in drafts]
        assert all(verify_host_reason(st, d, runner.sample_candidates) is None for st, d in zip(dev, drafts,
                                                                                                 strict=True))
        named = runner.verify_sampled(vrows, verify_inputs(dev, drafts, ban, q, V))
        logits = runner.verify(vrows)
        for r in range(len(host)):
            want = accept(logits[r], drafts[r], host[r], ban[r])
            got = accept_device({k: t[r] for k, t in named.items()}, drafts[r], dev[r])
            res["host"][r] += [x.token for x in want]
            res["device"][r] += [x.token for x in got]
            res["accepted"][0] += len(want) - 1
            res["accepted"][1] += len(got) - 1
            for g, w in zip(got, want, strict=False):
                if w.logprob is not None and g.token == w.token:
                    res["lp_diff"] = max(res["lp_diff"], abs(g.logprob - w.logprob))
            toks[r], pos[r] = want[-1].token, pos[r] + len(want)
    res["generators"] = all(h.generator is None or bool((h.generator.get_state() == d.generator.get_state()).all())
                            for h, d in zip(host, dev, strict=True))
    return res


def main(ckpt: Path, out: Path, tp: int) -> dict:
    from neuron_opt.backends.neuron.backend import import_xla

    import_xla(dump=True, devices=tp)
    from neuron_opt.compiler import CompileRequest, compile_artifact
    from neuron_opt.config import ParallelConfig
    from neuron_opt.executors import load_model

    compile_artifact(CompileRequest(model=str(ckpt), out=out, backend="neuron", dtype="float32", max_model_len=32,
                                    prefill_buckets=(16,), decode_buckets=(32,), batch_size=4, prefill_batch=4,
                                    block_size=32, parallel=ParallelConfig(tp=tp), use_cache=False,
                                    num_speculative_tokens=2),
                     log=lambda s: None, progress=False)
    return streams(load_model(out).runner, 12, tp)


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))))
