"""Run as a script: compile a checkpoint with the eager backend (no graphs: only the weight path) and print the
peak growth of the process's anonymous memory (RssAnon, sampled every 2 ms) over its value before compile, in
bytes, as JSON. File-backed pages (the memory-mapped safetensors being read) are not counted: the kernel can drop
them at any time, so they are not memory compile needs.

    python compile_memory_probe.py CKPT OUT DTYPE TP
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def main(ckpt: str, out: str, dtype: str, tp: int) -> dict:
    from neuron_opt.checkpoint import open_checkpoint
    from neuron_opt.compiler import CompileRequest, compile_artifact
    from neuron_opt.config import ParallelConfig

    open_checkpoint(ckpt).tokenizer()  # imports and tokenizer files warmed up before the baseline
    gc.collect()
    base = rss_anon()
    peak, done = [base], threading.Event()

    def poll() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.002)

    t = threading.Thread(target=poll)
    t.start()
    try:
        compile_artifact(CompileRequest(model=ckpt, out=Path(out), backend="eager", dtype=dtype, max_model_len=32,
                                        prefill_buckets=(16,), decode_buckets=(32,), parallel=ParallelConfig(tp=tp),
                                        use_cache=False), log=lambda s: None, progress=False)
    finally:
        done.set()
        t.join()
    return {"growth_bytes": peak[0] - base}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))))
