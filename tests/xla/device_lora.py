"""Run as a script (a fresh process per tp: SPMD mode is per process), or call `main` in a process whose torch_xla
started with the HLO dump and one device (tests/xla/conftest.py). Compiles a tiny checkpoint with `--backend neuron
--enable-lora` at the given tp, serves one mixed batch (base rows and adapter rows) and then adapters that evict
the resident ones, and prints one JSON object: each request's greedy tokens, the compilations counted from the
load to the end, the eviction count and the HLO facts of every bucket.

    python device_lora.py BASE OUT TP ADAPTER_DIR ...

The first two adapters run in the mixed batch (2 slots); the third, then the first again, are loaded into
evicted slots.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]  # the package before tests/ (whose neuron_opt/ folder would shadow it)

PROMPTS = [[5, 9, 13, 2, 44, 71, 8], [17, 3, 99, 120, 6], [30, 31, 32, 33, 34, 35, 36, 37, 38], [250, 11, 7]]
MAX_TOKENS = 8
MAX_LORAS, MAX_RANK = 2, 8


def main(base: Path, out: Path, tp: int, adapters: list[Path]) -> dict:
    from neuron_opt.backends.neuron.backend import import_xla

    import_xla(dump=True, devices=tp)
    import torch_xla.debug.metrics as met

    from neuron_opt.api import LLM
    from neuron_opt.artifact import read_manifest
    from neuron_opt.backends.neuron.backend import hlo_summary
    from neuron_opt.compiler import CompileRequest, compile_artifact
    from neuron_opt.config import ParallelConfig
    from neuron_opt.lora.config import LoraConfig
    from neuron_opt.lora.registry import LoRARequest
    from neuron_opt.runtime.sampling import SamplingParams

    compile_artifact(CompileRequest(model=str(base), out=out, backend="neuron", dtype="float32", batch_size=4,
                                    max_model_len=32, prefill_buckets=(16,), decode_buckets=(32,),
                                    decode_batches=(4,), offset_prefill=False, use_cache=False,
                                    parallel=ParallelConfig(tp=tp), lora=LoraConfig(MAX_LORAS, MAX_RANK)),
                     log=lambda s: None, progress=False)
    # places weights and stacks, compiles every bucket, the slot-write graph and the greedy sampling graphs
    llm = LLM(out)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    compiles, uncached = met.metric_data("CompileTime")[0], met.counter_value("UncachedCompile")
    reqs = {f"a{i}": LoRARequest(f"a{i}", str(p)) for i, p in enumerate(adapters)}
    runs = [["a0", None, "a1", None],  # a mixed batch: both slots and base rows
            ["a2", "a0"]]  # a2 evicts a0 (least recently used), then a0 evicts a1
    tokens = []
    for names in runs:
        outs = llm.generate_batch(PROMPTS[:len(names)], greedy, lora_request=[reqs[n] if n else None for n in names])
        tokens.append([[n, o.token_ids] for n, o in zip(names, outs, strict=True)])
    import torch_xla

    stacks = llm.runner.executor.ranks.lora.tensors()  # after the writes: still sharded as allocated (tp > 1)
    shardings = sorted({torch_xla._XLAC._get_xla_sharding_spec(t) for t in stacks})
    m = read_manifest(out)
    hlo = {key: hlo_summary((out / next(f for f in files if f.endswith(".hlo.txt"))).read_text())
           for key, files in m.graphs.items()}
    layouts = {key: (out / next(f for f in files if f.endswith(".hlo.txt"))).read_text().split("\n", 1)[0]
               for key, files in m.graphs.items()}
    return {"tokens": tokens, "new_compiles": met.metric_data("CompileTime")[0] - compiles,
            "new_uncached": (met.counter_value("UncachedCompile") or 0) - (uncached or 0),
            "evictions": llm.loras.stats.evictions, "loads": llm.loras.stats.loads, "hlo": hlo,
            "headers": layouts, "stack_shardings": shardings, "lora": m.lora.to_dict() if m.lora is not None else None}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), [Path(p) for p in sys.argv[4:]])))
