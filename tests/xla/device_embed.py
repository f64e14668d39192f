"""Run as a script (a fresh process per tp: SPMD mode is per process). Compiles a sentence-transformers
checkpoint with `--backend neuron --task embed` at the given tp, embeds the given texts through `LLM.embed` on the
artifact, and prints one JSON object: the vectors and the prefill buckets the calls ran.

    python device_embed.py CKPT OUT TP TEXTS_JSON
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]  # the package before tests/ (whose neuron_opt/ folder would shadow it)

EMBED = dict(dtype="float32", batch_size=4, prefill_batch=3, max_prompt_len=64, prefill_buckets=(32, 64),
             use_cache=False)  # the inputs run 3 to a graph call, mixed lengths padded to the call's bucket


def compile_embed(ckpt: Path, out: Path, tp: int = 1, **kw) -> Path:
    from neuron_opt.compiler import CompileRequest, compile_artifact
    from neuron_opt.config import ParallelConfig

    compile_artifact(CompileRequest(model=str(ckpt), out=out, backend="neuron", parallel=ParallelConfig(tp=tp),
                                    **{**EMBED, **kw}), log=lambda s: None, progress=False)
    return out


def embed(art: Path, texts: list[str]) -> tuple[list[list[float]], list[str]]:
    """(the texts' vectors, the bucket of each graph call)."""
    from neuron_opt.api import LLM

    llm = LLM(str(art))
    buckets: list[str] = []
    embed_rows = llm.runner.embed_rows

    def record(rows):
        out = embed_rows(rows)
        buckets.append(llm.runner.last_bucket.key)
        return out

    llm.runner.embed_rows = record
    return llm.embed(texts), buckets


def main(ckpt: Path, out: Path, tp: int, texts: list[str]) -> dict:
    from neuron_opt.backends.neuron.backend import import_xla

    import_xla(dump=True, devices=tp)
    vectors, buckets = embed(compile_embed(ckpt, out, tp), texts)
    return {"vectors": vectors, "buckets": buckets}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))))
