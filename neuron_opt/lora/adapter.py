"""PEFT LoRA adapters: read with bounded reads, validated against the base model and the compiled capacity,
then zero-padded to the compiled rank and sharded per rank the way the base layer is.

Accepted (docs/lora.md): a directory with `adapter_config.json` (peft_type LORA, `r`, `lora_alpha`,
`use_rslora`, `target_modules` as names or a regex, per-module `rank_pattern` / `alpha_pattern`, `fan_in_fan_out`,
`bias` "none") and `adapter_model.safetensors` (`base_model.model.<module>.lora_A.weight` [r, in] and
`.lora_B.weight` [out, r], float32 / bfloat16 / float16). Refused, each with the field named: other bias modes,
`modules_to_save`, DoRA, embedding or LM-head adapters, a rank above the compiled maximum, a module the artifact
was not compiled to adapt, a shape that is not the base layer's. Nothing is kept of an adapter that fails: it is
read whole and checked before any slot is written.

Per-module ranks and alphas resolve as PEFT resolves them: a module takes the value of the first pattern key
(in the file's order) that matches the end of its name at a dot boundary (the key is a regex), else `r` /
`lora_alpha`; its scale is its alpha / its rank (/ sqrt(rank) with `use_rslora`), and its A and B are zero-padded
from its own rank to the compiled one.

Sharding (Megatron, as `neuron_opt.parallel.sharding` does the base weights): a column-parallel linear
(q/k/v, gate/up) keeps A whole and takes its rows of B (head padding and KV replication alike: padded heads' rows
are zero); a row-parallel one (o, down) takes its input columns of A and keeps B whole, and its partial product
joins the base layer's all-reduce.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from neuron_opt.config import ModelConfig
from neuron_opt.errors import CheckpointError, ConfigError
from neuron_opt.headers import read_json_capped, safetensors_header
from neuron_opt.hub import resolve_adapter
from neuron_opt.lora.config import ATTENTION_TARGETS, ROW_PARALLEL, TARGET_MODULES, LoraConfig, full_shapes
from neuron_opt.parallel.sharding import HeadLayout, shard_tensor

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_ADAPTER_BYTES = 8 << 30
_KEY = re.compile(r"base_model\.model\.(model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+))\.lora_([AB])\.weight")
_FLOAT_DTYPES = {"F32", "BF16", "F16"}
_SUPPORTED_TYPES = ("LORA",)


def _bad(path: Path, field: str, msg: str) -> ConfigError:
    return ConfigError(f"lora adapter {path}: {field}: {msg}", param="lora_path")


@dataclass(frozen=True)
class LoraAdapter:
    """A validated adapter, unsharded: (layer, module) -> (A [r, in], B [out, r] with the scale folded in), fp32.
    `rank`: the largest of its modules' ranks; `scale`: the scale of a module without a pattern (`r`, `lora_alpha`).

    `digest`: sha256 of its weights file, which keys its prefix-cache blocks (the same file under two names shares
    them, a different file never does)."""

    path: str
    rank: int
    scale: float
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: str


def _targets_module(spec: Any, key: str) -> bool:
    """Whether PEFT's `target_modules` (a list of names, a regex string, or "all-linear") selects module `key`."""
    if isinstance(spec, str):
        return spec == "all-linear" or re.fullmatch(spec, key) is not None
    return any(key == t or key.endswith("." + t) for t in spec)


def _patterns(path: Path, conf: dict[str, Any], field: str, rank: bool) -> dict[str, int | float]:
    """PEFT's `rank_pattern` or `alpha_pattern`: {module-name regex: positive integer rank | finite alpha}."""
    pat = conf.get(field) or {}
    if not isinstance(pat, dict):
        raise _bad(path, field, f"must be an object mapping module names to values, got {pat!r}")
    for key, value in pat.items():
        try:
            re.compile(key)
        except re.error as e:
            raise _bad(path, field, f"key {key!r} is not a valid regex ({e})") from None
        if rank and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise _bad(path, field, f"{key!r}: a rank must be a positive integer, got {value!r}")
        if not rank and (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)):
            raise _bad(path, field, f"{key!r}: an alpha must be a finite number, got {value!r}")
    return pat


def _pattern_value(pat: dict[str, int | float], module: str, default: int | float) -> tuple[int | float, str | None]:
    """The value of the first key of `pat` matching the end of `module` at a dot boundary (PEFT's
    get_pattern_key), with that key; `default` and None when none matches."""
    for key, value in pat.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value, key
    return default, None


def adapter_dir(path: str | Path) -> Path:
    """The adapter's local directory: `path`, or a Hub id's files fetched into the Hub cache (neuron_opt.hub);
    ConfigError (param "lora_path") when the Hub cannot supply them."""
    try:
        return Path(resolve_adapter(path))
    except CheckpointError as e:
        raise ConfigError(str(e), param="lora_path") from None


def read_adapter(path: str | Path, cfg: ModelConfig, lora: LoraConfig) -> LoraAdapter:
    """Read and validate the PEFT adapter at `path` for a base model `cfg` compiled with capacity `lora`;
    ConfigError (param "lora_path") naming the file and the field otherwise. A Hub id is fetched first
    (neuron_opt.hub)."""
    path = Path(adapter_dir(path))
    if not path.is_dir():
        raise _bad(path, "path", "not a directory (a PEFT adapter directory holds adapter_config.json and "
                   "adapter_model.safetensors)")
    conf_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not conf_path.is_file():
        raise _bad(path, CONFIG_FILE, "missing")
    if not weights_path.is_file():
        other = " (adapter_model.bin is a pickle, which is never loaded: save with safe_serialization)" \
            if (path / "adapter_model.bin").exists() else ""
        raise _bad(path, WEIGHTS_FILE, f"missing{other}")
    try:
        conf = read_json_capped(conf_path, CheckpointError, "lora adapter")
    except CheckpointError as e:
        raise ConfigError(str(e), param="lora_path") from None
    if not isinstance(conf, dict):
        raise _bad(path, CONFIG_FILE, "not a JSON object")
    peft_type = conf.get("peft_type", "LORA")
    if peft_type not in _SUPPORTED_TYPES:
        raise _bad(path, "peft_type", f"{peft_type!r} is not LoRA; only LoRA adapters are served")
    r, alpha = conf.get("r"), conf.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _bad(path, "r", f"must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise _bad(path, "lora_alpha", f"must be a finite number, got {alpha!r}")
    if r > lora.max_lora_rank and not conf.get("rank_pattern"):  # else checked per module, below
        raise _bad(path, "r", f"rank {r} exceeds this artifact's --max-lora-rank {lora.max_lora_rank}; recompile "
                   f"with --max-lora-rank {r} or more")
    if conf.get("bias", "none") != "none":
        raise _bad(path, "bias", f"{conf.get('bias')!r}: only bias \"none\" is supported (trained biases would "
                   "change the base layers for every request)")
    if conf.get("modules_to_save"):
        raise _bad(path, "modules_to_save", f"{conf['modules_to_save']}: adapters that replace whole modules are "
                   "not supported (they are full weights, not a low-rank term)")
    if conf.get("use_dora"):
        raise _bad(path, "use_dora", "DoRA adapters are not supported")
    rank_pattern = _patterns(path, conf, "rank_pattern", rank=True)
    alpha_pattern = _patterns(path, conf, "alpha_pattern", rank=False)
    rslora = conf.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise _bad(path, "use_rslora", f"must be true or false, got {rslora!r}")
    fan = conf.get("fan_in_fan_out", False)
    if not isinstance(fan, bool):
        raise _bad(path, "fan_in_fan_out", f"must be true or false, got {fan!r}")
    # fan_in_fan_out describes the base layer's storage (GPT-2's Conv1D); lora_A / lora_B are nn.Linear weights
    # ([r, in], [out, r]) either way, and Llama-family projections are nn.Linear, which PEFT runs the same
    spec = conf.get("target_modules")
    if not (isinstance(spec, str) or (isinstance(spec, list) and all(isinstance(t, str) for t in spec))):
        raise _bad(path, "target_modules", f"must be a list of module names or a regex string, got {spec!r}")

    def scale_of(rank: int, a: float) -> float:
        return a / math.sqrt(rank) if rslora else a / rank

    scale = scale_of(r, alpha)

    size = weights_path.stat().st_size
    if size > MAX_ADAPTER_BYTES:
        raise _bad(path, WEIGHTS_FILE, f"{size} bytes, more than the {MAX_ADAPTER_BYTES >> 30} GiB an adapter may be")
    try:
        header = safetensors_header(weights_path)  # every entry checked against the file before anything is read
    except CheckpointError as e:
        raise ConfigError(str(e), param="lora_path") from None
    shapes = full_shapes(cfg)
    found: dict[tuple[int, str], dict[str, str]] = {}
    module_scale: dict[tuple[int, str], float] = {}
    for name, entry in header.items():
        m = _KEY.fullmatch(name)
        if m is None:
            raise _bad(path, WEIGHTS_FILE, f"tensor {name!r} is not a LoRA A/B weight of a decoder layer's "
                       "projection (embedding and LM-head adapters, DoRA magnitudes, biases are not supported)")
        module, layer, module_name, ab = m.group(1), int(m.group(2)), m.group(4), m.group(5)
        if module_name not in TARGET_MODULES or (module_name in ATTENTION_TARGETS) != (m.group(3) == "self_attn"):
            raise _bad(path, WEIGHTS_FILE, f"tensor {name!r}: {module_name} is not one of {list(TARGET_MODULES)}")
        if layer >= cfg.num_hidden_layers:
            raise _bad(path, WEIGHTS_FILE, f"tensor {name!r}: layer {layer} does not exist (the base model has "
                       f"{cfg.num_hidden_layers})")
        if not _targets_module(spec, module):
            raise _bad(path, "target_modules", f"{spec!r} does not select {module}, yet the file holds {name!r}")
        if module_name not in lora.target_modules:
            raise _bad(path, "target_modules", f"the adapter targets {module_name}, which this artifact was not "
                       f"compiled for (--lora-target-modules {' '.join(lora.target_modules)})")
        if entry["dtype"] not in _FLOAT_DTYPES:
            raise _bad(path, WEIGHTS_FILE, f"tensor {name!r} is {entry['dtype']}; adapters are float32, bfloat16 or "
                       "float16")
        r_m, key = _pattern_value(rank_pattern, module, r)
        where = f" (rank_pattern {key!r})" if key is not None else ""
        if r_m > lora.max_lora_rank:
            raise _bad(path, "r" if key is None else "rank_pattern", f"{module}: rank {r_m}{where} exceeds this "
                       f"artifact's --max-lora-rank {lora.max_lora_rank}; recompile with --max-lora-rank {r_m} or more")
        in_f, out_f = shapes[module_name]
        want = [r_m, in_f] if ab == "A" else [out_f, r_m]
        if list(entry["shape"]) != want:
            raise _bad(path, WEIGHTS_FILE, f"tensor {name!r} has shape {entry['shape']}, the base model's "
                       f"{module_name} with r={r_m}{where} needs {want} (an adapter trained on another base model?)")
        found.setdefault((layer, module_name), {})[ab] = name
        module_scale[(layer, module_name)] = scale_of(r_m, _pattern_value(alpha_pattern, module, alpha)[0])
    if not found:
        raise _bad(path, WEIGHTS_FILE, "holds no LoRA weights")
    for (layer, module_name), parts in found.items():
        if set(parts) != {"A", "B"}:
            raise _bad(path, WEIGHTS_FILE, f"layer {layer} {module_name}: has lora_{''.join(parts)} without its "
                       f"lora_{'B' if 'A' in parts else 'A'}")
    data = weights_path.read_bytes()
    tensors = load_file(str(weights_path))
    weights = {}
    for key, parts in sorted(found.items()):
        a, b = tensors[parts["A"]].float(), tensors[parts["B"]].float() * module_scale[key]
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise _bad(path, WEIGHTS_FILE, f"layer {key[0]} {key[1]}: holds non-finite values")
        weights[key] = (a.contiguous(), b.contiguous())
    targets = tuple(t for t in TARGET_MODULES if any(k[1] == t for k in weights))
    rank = max(a.shape[0] for a, _ in weights.values())
    return LoraAdapter(str(path), rank, float(scale), targets, weights, hashlib.sha256(data).hexdigest())


def _pad_rank(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [r, in] and B [out, r] zero-padded to the compiled rank: A [R, in], B [out, R]."""
    r = a.shape[0]
    if r == rank:
        return a, b
    return (torch.cat([a, a.new_zeros(rank - r, a.shape[1])], 0), torch.cat([b, b.new_zeros(b.shape[0], rank - r)], 1))


def rank_tensors(adapter: LoraAdapter, cfg: ModelConfig, layout: HeadLayout, lora: LoraConfig,
                 rank: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Rank `rank`'s padded shards of `adapter`: (layer, module) -> (A [R, in_local], B [out_local, R]), fp32."""
    out = {}
    for (layer, module), (a, b) in adapter.weights.items():
        a, b = _pad_rank(a, b, lora.max_lora_rank)
        where = "self_attn" if module in ATTENTION_TARGETS else "mlp"
        base = f"model.layers.{layer}.{where}.{module}.weight"  # the base weight's sharding rule applies
        if module in ROW_PARALLEL:
            a = shard_tensor(base, a, cfg, layout, rank)  # [R, in] split on its input features
        else:
            b = shard_tensor(base, b, cfg, layout, rank)  # [out, R] split on its output features (heads)
        assert a is not None and b is not None
        out[(layer, module)] = (a.contiguous(), b.contiguous())
    return out


def load_into_slot(stacks: Any, slot: int, adapter: LoraAdapter, model: torch.nn.Module) -> None:
    """Write `adapter` into `slot` of a rank model's stacks (neuron_opt.lora.ops.LoraStacks): its rank's shards."""
    stacks.set_slot(slot, rank_tensors(adapter, model.cfg, model.layout, model.lora_config, model.pctx.rank))


def capacity_for(path: str | Path) -> LoraConfig:
    """The smallest LoRA capacity that runs the one adapter at `path` (an uncompiled model's, `generate --model
    ... --lora PATH`): one slot of its rank over every target module. Checked in full when it is loaded."""
    path = adapter_dir(path)
    conf_path = Path(path) / CONFIG_FILE
    if not conf_path.is_file():
        raise _bad(Path(path), CONFIG_FILE, "missing")
    try:
        conf = read_json_capped(conf_path, CheckpointError, "lora adapter")
        r = conf.get("r")
    except (CheckpointError, AttributeError) as e:
        raise _bad(Path(path), CONFIG_FILE, f"unreadable ({e})") from None
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _bad(Path(path), "r", f"must be a positive integer, got {r!r}")
    ranks = _patterns(Path(path), conf, "rank_pattern", rank=True).values()
    return LoraConfig(1, max([r, *ranks]))
