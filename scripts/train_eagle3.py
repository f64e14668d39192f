#!/usr/bin/env python
"""Train an EAGLE-3 head for a model (neuron_opt/eagle3_train.py), saved in the speculators layout in --out, which
`--speculative-method eagle3 --speculative-model OUT` then loads. Data: the model's own greedy answers to the chats
of --prompts (JSONL: {"messages": [...]}, a list of messages, or {"prompt": text}) or to the built-in seed
prompts; hidden states captured once (<out>/data.pt); resumable (<out>/checkpoint.pt: run the same command again).
Runs on CPU, in float32, with a progress bar.

    python scripts/train_eagle3.py --model default --out heads/default --steps 300
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a checkpoint (HF directory, GGUF, 'default', or a Hub id)")
    p.add_argument("--out", required=True, type=Path, help="the head's directory (and its data and checkpoint)")
    p.add_argument("--prompts", default=None, help="a JSONL of chats (default: the built-in seed prompts)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps, one sequence each (default 300)")
    p.add_argument("--ttt-steps", type=int, default=3, help="training-time-test steps (default 3)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="answer length per prompt (default 128)")
    p.add_argument("--max-model-len", type=int, default=1024, help="longest prompt + answer (default 1024)")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (default 100)")
    p.add_argument("--aux-layers", type=int, nargs=3, default=None, metavar="ID",
                   help="the model layers whose input states the head reads (default 2, L/2, L-3)")
    p.add_argument("--draft-vocab-size", type=int, default=None, metavar="N",
                   help="propose among the N tokens most frequent in the data (default: the whole vocabulary); a "
                        "smaller LM head makes each proposal cheaper")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from neuron_opt.api import LLM
    from neuron_opt.eagle3_train import SEED_PROMPTS, TrainConfig, read_prompts, train

    chats = read_prompts(args.prompts) if args.prompts else [[{"role": "user", "content": t}] for t in SEED_PROMPTS]
    cfg = TrainConfig(out=args.out, steps=args.steps, ttt_steps=args.ttt_steps, lr=args.lr,
                      max_new_tokens=args.max_new_tokens, checkpoint_every=args.checkpoint_every, seed=args.seed,
                      aux_layers=tuple(args.aux_layers) if args.aux_layers else None,
                      draft_vocab_size=args.draft_vocab_size)
    llm = LLM(args.model, batch_size=4, max_model_len=args.max_model_len)
    train(llm, chats, cfg, verifier=str(args.model))
    print(f"head: {args.out} (--speculative-method eagle3 --speculative-model {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
