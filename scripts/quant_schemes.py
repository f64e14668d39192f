"""Which int8 weight-only scheme could meet a teacher-forced agreement floor on the default model?

A sweep outside compile. Each scheme quantizes and dequantizes HF's fp32 copy of the default model ("fake
quantization"): the seven decoder projections of every layer; embeddings and the LM head stay fp32. The reference is
the same model unquantized, which is the GGUF's Q4_1 values in fp32 (the slow test's reference). Activations stay
fp32, so only the weights' rounding differs. Measured per scheme:
- greedy agreement over `--tokens` teacher-forced tokens of the slow test's chat prompt;
- perplexity on the slow test's paragraph, against the reference's;
- the scheme's bytes per weight, int8 values plus fp32 scales (and zero points where the scheme has them).

Schemes: symmetric (scale = amax / 127) or asymmetric (scale = (max - min) / 255, offset = min), per output channel
or per group of G consecutive input features. Only per-channel symmetric int8 is what `compile --quantize int8`
builds (torch's CPU int8 kernel takes one scale per row); the others are here to show what a different format
would buy.

    python scripts/quant_schemes.py --groups 192,64,32 --json docs/bench/quant_schemes.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fake_quant(w, group: int, symmetric: bool):
    """`w` [N, K] through int8 and back; `group` 0: one scale per output channel."""
    import torch

    n, k = w.shape
    g = k if group == 0 else group
    if k % g:
        raise SystemExit(f"--groups: {g} does not divide the input width {k}")
    wg = w.view(n, k // g, g)
    if symmetric:
        scale = wg.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
        return (torch.round(wg / scale).clamp(-127, 127) * scale).view(n, k)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    scale = (hi - lo).clamp_min(1e-12) / 255
    return (torch.round((wg - lo) / scale).clamp(0, 255) * scale + lo).view(n, k)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", default="192,64,32", help="group sizes to try besides per channel (must divide 576 "
                                                         "and 1536, the default model's input widths)")
    p.add_argument("--tokens", type=int, default=256, help="teacher-forced tokens (the slow test's 256)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)

    import torch
    import transformers

    sys.path.insert(0, str(ROOT))
    from neuron_opt.bench import host
    from neuron_opt.bench.decode import PERPLEXITY_TEXT, hf_reference
    from neuron_opt.checkpoint import default_model_path, open_checkpoint

    torch.set_num_threads(args.threads)
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    tok = open_checkpoint("default").tokenizer()
    prompt, ref = hf_reference(model, tok, args.tokens)
    seq = torch.tensor([prompt + ref])
    text = torch.tensor([tok.encode(PERPLEXITY_TEXT)])

    def measure(m) -> tuple[float, float]:
        with torch.inference_mode():
            pred = m(seq).logits[0, len(prompt) - 1:-1].argmax(-1)
            logits = m(text).logits[0, :-1]
        nll = torch.nn.functional.cross_entropy(logits, text[0, 1:]).item()
        return (pred == torch.tensor(ref)).float().mean().item(), math.exp(nll)

    base_agree, base_ppl = measure(model)
    rows = []
    for symmetric in (True, False):
        for group in [0, *(int(g) for g in args.groups.split(","))]:
            q = copy.deepcopy(model)
            with torch.no_grad():
                for name, mod in q.named_modules():
                    if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS:
                        mod.weight.copy_(fake_quant(mod.weight, group, symmetric))
            agree, ppl = measure(q)
            per_group = 4 if symmetric else 8  # fp32 scale (and offset) per group or row
            bytes_per_weight = 1 + per_group / (group or 576)  # per channel: the narrowest rows (K = 576)
            rows.append({"scheme": f"{'symmetric' if symmetric else 'asymmetric'}, "
                                   f"{'per channel' if group == 0 else f'group {group}'}",
                         "symmetric": symmetric, "group": group, "agreement": agree,
                         "agreed_tokens": round(agree * len(ref)), "perplexity_ratio": ppl / base_ppl,
                         "bytes_per_weight_max": bytes_per_weight})
            print(f"{rows[-1]['scheme']:<28} agreement {agree:.4f} ({rows[-1]['agreed_tokens']}/{len(ref)})  "
                  f"perplexity {100 * (ppl / base_ppl - 1):+.2f}%  bytes/weight <= {bytes_per_weight:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"host": host(), "torch": torch.__version__, "tokens": len(ref),
                                         "reference": {"agreement": base_agree, "perplexity": base_ppl},
                                         "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
