"""Multi-LoRA serving: PEFT adapters applied per row on one compiled base model (docs/lora.md).

- `config.py`: `LoraConfig`, the compile-time capacity (slots, rank, target modules), recorded in the manifest.
- `ops.py`: the per-row product the model computes (BGMV) and the per-rank adapter stacks the graphs take.
- `adapter.py`: PEFT adapter directories read with bounded reads, validated, padded and sharded per rank.
- `registry.py`: the adapters known to a server and the slots they occupy (filled on demand, LRU eviction).
"""
