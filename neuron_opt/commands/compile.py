"""`neuron-opt compile`: checkpoint -> artifact directory (one graph per bucket, weights once per rank)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from neuron_opt.backends import BACKENDS
from neuron_opt.commands.generate import add_s3_endpoint_flag
from neuron_opt.commands.hub_flags import MODEL_HELP, add_hub_flags
from neuron_opt.commands.lora_flags import add_compile_flags as add_lora_flags
from neuron_opt.commands.lora_flags import lora_config_from_args
from neuron_opt.commands.parallel_flags import add_parallel_flags, parallel_config_from_args
from neuron_opt.config import KVCacheDtype


def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(sorted({int(v) for v in text.replace(",", " ").split()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a list of integers like '128,256,512', got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _option(text: str) -> tuple[str, object]:
    """KEY=VALUE; VALUE is read as JSON where it parses (true, 3, ["-O2"]), else kept as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compile", help="compile a checkpoint into an artifact (one graph per shape bucket)")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    add_hub_flags(p)
    p.add_argument("--out", required=True,
                   help="artifact directory to write (atomically), or an s3:// URI: compiled locally, then uploaded "
                        "(the manifest last) and kept in the local artifact cache")
    p.add_argument("--backend", default="cpu", choices=BACKENDS)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="compute dtype (default: bfloat16 on CPUs with native bf16 and on Neuron, else float32)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="most sequences decoded together (the largest decode batch); also sizes the default KV "
                        "block pool")
    p.add_argument("--max-prompt-len", "--max-context", type=int, default=None,
                   help="the largest prefill bucket: the longest prompt run in one call; longer ones run in chunks "
                        "of it where offset prefill is on (default: max_model_len; a model with sliding-window "
                        "layers: its window, at least 128, where that makes those layers' KV window-sized; "
                        "--max-context: old spelling)")
    p.add_argument("--max-model-len", "--max-length", type=int, default=None,
                   help="most tokens one sequence holds, prompt + generated: the KV cache length per sequence and "
                        "the largest decode bucket (vLLM's name; --max-length: old spelling)")
    p.add_argument("--prefill-buckets", type=_int_list, default=None, help="e.g. 128,256,512")
    p.add_argument("--decode-buckets", type=_int_list, default=None, help="KV lengths, e.g. 256,1024,2048")
    p.add_argument("--decode-batches", type=_int_list, default=None, help="batch sizes, e.g. 1,4,8")
    p.add_argument("--encoder-buckets", type=_int_list, default=None, metavar="SIZES",
                   help="a vision-language model's encoder buckets, in image tiles (Idefics3, SmolVLM) or patches "
                        "(Qwen2.5-VL), e.g. 1,2,4,5 (default: powers of two up to the largest image its processor "
                        "makes; docs/multimodal.md)")
    p.add_argument("--speculative-model", default=None, metavar="PATH",
                   help="a draft model (HF directory, GGUF, 'default', or a Hub id at its main revision) with this "
                        "model's tokenizer, compiled alongside into <out>/draft with this compile's backend, dtype, "
                        "batch size and max-model-len; serve/generate --speculative-method draft_model then use it "
                        "(needs --num-speculative-tokens)")
    p.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K",
                   help="also compile verify graphs of K + 1 tokens per row (one per decode bucket) for "
                        "speculative decoding: serve/generate --speculative-method ngram")
    p.add_argument("--block-size", type=int, default=32, help="positions per KV cache block (default 32)")
    p.add_argument("--num-kv-blocks", type=int, default=0, metavar="N",
                   help="KV blocks in the pool, the null block included (default: batch size x blocks of one "
                        "max_model_len sequence + 1); fewer serve mixed lengths in less memory, more keep more "
                        "prefixes cached")
    p.add_argument("--offset-prefill", "--chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the offset prefill buckets (a prefill after cached tokens) that prefix caching, "
                        "chunked prefill and preemption need (default: on, except with the neuron backend's "
                        "ops=nki, whose kernels assume a prompt from position 0; --chunked-prefill: old spelling)")
    p.add_argument("--prefill-batch", type=int, default=1, metavar="N",
                   help="prompts (or chunks) prefilled together in one graph call (default 1)")
    p.add_argument("--quantize", default=None, choices=["int8", "int4", "fp8", "auto"],
                   help="weight-only quantization of the decoder's linear projections (docs/quantization.md): "
                        "int8/fp8 per channel, int4 per group; auto keeps a GGUF's own format (Q4_0/Q4_1 as "
                        "stored, Q8_0 as int8). Embeddings and the LM head stay in --dtype. fp8: neuron/eager")
    p.add_argument("--quantization-type", default="",
                   choices=["", "per_channel_symmetric", "per_tensor_symmetric", "group_asymmetric",
                            "group_symmetric"],
                   help="int8/fp8: per_channel_symmetric (default) or per_tensor_symmetric; int4: "
                        "group_asymmetric (default, as Q4_1) or group_symmetric (as Q4_0)")
    p.add_argument("--group-size", type=int, default=0, help="int4 group size: 32 (default), 64, 128 or 256")
    p.add_argument("--modules-to-not-convert", default="", metavar="NAMES",
                   help="comma list of module names left unquantized (substring match, as NxDI), e.g. "
                        "mlp.down_proj")
    p.add_argument("--quantize-lm-head", action=argparse.BooleanOptionalAction, default=None,
                   help="also quantize the LM head, int8 per output channel (fp8 under --quantize fp8); default: "
                        "off, except that --quantize auto keeps a GGUF's quantized head (SmolLM2's Q8_0 table)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=[d.value for d in KVCacheDtype],
                   help="auto: the compute dtype; fp8: e4m3 with per-layer scales calibrated at compile time")
    emb = p.add_argument_group("embedding models (docs/embeddings.md)")
    emb.add_argument("--task", default=None, choices=["generate", "embed"],
                     help="generate: an LM head, text generation; embed: prefill graphs that pool the final hidden "
                          "states into one vector per input (/v1/embeddings, LLM.embed). Default: embed for a "
                          "sentence-transformers checkpoint (modules.json) or a bare decoder (Qwen3Model, ...), "
                          "else generate")
    emb.add_argument("--pooling", default=None, choices=["last", "mean", "cls"],
                     help="embed: the pooling step (default: the checkpoint's sentence-transformers Pooling module)")
    emb.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                     help="embed: L2-normalise the pooled vector (default: as the checkpoint's Normalize module says; "
                          "on for a checkpoint without sentence-transformers files)")
    emb.add_argument("--matryoshka-dims", type=_int_list, default=None, metavar="DIMS",
                     help="embed: the sizes a request's `dimensions` may truncate the vector to (a model trained "
                          "for it, e.g. 32,64,128,256,512,1024); default: none")
    p.add_argument("--backend-option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                   help="a backend option (repeatable; see docs/cpu_backend.md and docs/neuron_backend.md), "
                        "e.g. replay=false or compiler_args='-O2'")
    p.add_argument("--no-cache", action="store_true", help="do not use the compile cache")
    p.add_argument("--force", action="store_true",
                   help="replace --out even when it is a non-empty directory that is not an artifact (its contents "
                        "are deleted); without it only an artifact or an empty directory is replaced")
    add_s3_endpoint_flag(p)
    p.add_argument("--sign-key", type=Path, default=None, metavar="KEY",
                   help="sign the artifact with this Ed25519 private key (`neuron-opt keygen`): manifest.sig, which "
                        "serve/generate/inspect --trusted-keys check (docs/design.md)")
    add_parallel_flags(p)
    add_lora_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # here, not at the top: the CLI parses without loading the compiler (models, backends, transformers) or the
    # artifact readers (cryptography)
    from neuron_opt import object_store
    from neuron_opt.compiler import CompileRequest, compile_artifact

    remote = object_store.is_remote(args.out)
    if remote:  # a bad URI or an occupied prefix fails now, not after the compile
        object_store.check_destination(args.out, endpoint_url=args.s3_endpoint_url, force=args.force)
    out = object_store.staging_dir() if remote else Path(args.out)
    req = CompileRequest(
        model=args.model, revision=args.revision, gguf_file=args.gguf_file, out=out, backend=args.backend,
        dtype=args.dtype, batch_size=args.batch_size,
        max_prompt_len=args.max_prompt_len, max_model_len=args.max_model_len, prefill_buckets=args.prefill_buckets,
        decode_buckets=args.decode_buckets, decode_batches=args.decode_batches,
        parallel=parallel_config_from_args(args),
        backend_options=dict(args.backend_option), use_cache=not args.no_cache,
        num_speculative_tokens=args.num_speculative_tokens, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, offset_prefill=args.offset_prefill, prefill_batch=args.prefill_batch,
        quantize=args.quantize, quantization_type=args.quantization_type, group_size=args.group_size,
        modules_to_not_convert=tuple(m.strip() for m in args.modules_to_not_convert.split(",") if m.strip()),
        quantize_lm_head=args.quantize_lm_head, kv_cache_dtype=KVCacheDtype.parse(args.kv_cache_dtype),
        speculative_model=args.speculative_model, force=args.force, sign_key=args.sign_key, task=args.task,
        pooling=args.pooling, normalize=args.normalize, matryoshka_dims=args.matryoshka_dims,
        lora=lora_config_from_args(args),
        encoder_buckets=tuple(args.encoder_buckets) if args.encoder_buckets else None)
    report = compile_artifact(req)
    print(f"compile cache: {len(report.hits)} hit(s), {len(report.misses)} miss(es)")
    for label, why in report.misses.items():
        print(f"  miss {label}: {why}")
    if not remote:
        print(f"artifact written to {args.out} in {report.seconds:.1f} s")
        return 0
    try:
        loc = object_store.push(out, args.out, endpoint_url=args.s3_endpoint_url, force=args.force)
    except BaseException:
        print(f"the compiled artifact stays at {out}; upload it with `neuron-opt push {out} {args.out}`",
              file=sys.stderr)
        raise
    local = object_store.adopt(out)
    print(f"artifact compiled in {report.seconds:.1f} s, uploaded to {loc} (local copy: {local})")
    return 0
