"""`neuron-opt inspect DIR`: print an artifact's manifest readably (and verify it)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from neuron_opt.commands.generate import add_trusted_keys_flag, resolve_artifact_arg
from neuron_opt.embeddings import describe as describe_task


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="show and verify an artifact's manifest")
    p.add_argument("artifact", help="artifact directory, or its s3:// URI (pulled into the local artifact cache)")
    p.add_argument("--json", action="store_true", help="print the raw manifest")
    add_trusted_keys_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from neuron_opt.artifact import read_verified  # here: the CLI parses without the artifact readers (cryptography)

    resolve_artifact_arg(args)
    args.artifact = Path(args.artifact)
    verified = read_verified(args.artifact, trusted_keys=args.trusted_keys)
    m, raw = verified.manifest, verified.raw  # what was verified, not a second read of the file
    if args.json:
        print(json.dumps(raw, indent=2, sort_keys=True))
        return 0
    size = sum((args.artifact / f).stat().st_size for f in m.files)
    c = m.model
    print(f"artifact: {args.artifact}  (verified: {len(m.files)} files, {size / 2**20:.1f} MiB)")
    print(f"  signature: {verified.signature}")
    print("  versions: " + ", ".join(f"{k} {v}" for k, v in sorted(m.versions.items())))
    print(f"  model: {c.architecture}, {c.num_hidden_layers} layers, hidden {c.hidden_size}, heads "
          f"{c.num_attention_heads}/{c.num_key_value_heads} (q/kv), vocab {c.vocab_size}, "
          f"{c.num_parameters() / 1e6:.1f}M params")
    print(f"  source: {m.source.get('model')} ({m.source.get('format')})")
    experts = ""
    if m.model.is_moe:
        experts = f", ep: {m.parallel.ep}" + (f" (decode and verify: {m.parallel.decode_ep}, a second copy of the "
                                              "experts)" if m.parallel.decode_ep != m.parallel.ep else "")
    print(f"  backend: {m.backend}, dtype: {m.dtype}, tp: {m.parallel.tp}{experts}")
    q = m.quant
    if q.enabled:
        group = f", group {q.group_size}" if q.group_size else ""
        skip = f", not converted: {', '.join(q.modules_to_not_convert)}" if q.modules_to_not_convert else ""
        print(f"  quantized: {q.method} {q.quantization_type}{group}{', LM head too' if q.lm_head else ''}"
              f"{', as stored in the GGUF' if q.source else ''}{skip}")
    print(f"  cache: {m.cache.num_blocks} KV blocks of {m.cache.block_size} positions (the null block included), "
          f"max_model_len {m.cache.max_model_len}, decode batch up to {m.cache.max_batch}")
    print(f"  KV geometry: {raw['kv_geometry']}")
    print(f"  prefill buckets: {list(m.buckets.prefill_lens)}")
    if m.buckets.prefill_only:
        print(f"  {describe_task(m.model)} (prefill graphs only; at most {m.buckets.decode_batches[-1]} inputs in "
              "flight)")
    else:
        print(f"  decode buckets: batch {list(m.buckets.decode_batches)} x kv {list(m.buckets.decode_kv_lens)}")
    print(f"  graphs: {len(m.graphs)}")
    if m.backend == "neuron":  # what each bucket's HLO promises: donated KV, collectives, nothing host-bound
        from neuron_opt.backends.neuron.backend import hlo_summary  # here: only a neuron artifact needs the backend

        for key, files in sorted(m.graphs.items()):
            for f in (f for f in files if f.endswith(".hlo.txt")):
                h = hlo_summary((args.artifact / f).read_text())
                coll = ", ".join(f"{n} {k}" for k, n in h["collectives"].items()) or "none"
                print(f"    {key}: {f}: {h['parameters']} parameters, {h['donated']} donated (KV), "
                      f"collectives: {coll}, host ops: {h['host_ops'] or 'none'}, "
                      f"static shapes: {'no' if h['dynamic_shapes'] else 'yes'}")
            for f in (f for f in files if f.endswith(".kernels.json")):  # ops=nki
                for c in json.loads((args.artifact / f).read_text()):
                    print(f"      {c['op']} {c['shape']}: {c['kernel'] or 'torch'} ({c['reason']})")
    return 0
