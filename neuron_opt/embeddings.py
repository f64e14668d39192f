"""Embedding models: what a sentence-transformers checkpoint declares, and the task a compile or load resolves to.

An embedding model is our decoder with its LM head replaced by a pooling step (ModelConfig.pooling: "last",
"mean" or "cls" over the final norm's hidden states, then an optional L2 normalisation); models/pooling.py runs it.
The contract (pooling, normalisation, `dimensions`, the HTTP route) is docs/embeddings.md.

Design decisions
- A checkpoint directory with sentence-transformers files (`modules.json`) says how it pools: the Transformer
  module at the directory's root, then one Pooling module (`1_Pooling/config.json`: exactly one of the cls, mean
  or last-token modes), then optionally Normalize. Any other module (Dense, a second Transformer, ...) or pooling
  mode (max, weighted mean, mean over sqrt(len), a mean that excludes the prompt) is refused naming the field:
  computing a vector other than the checkpoint's would be a silent error.
- A Transformer module with sentence-transformers >= 6's `message` modality (saved when the tokenizer has a chat
  template) renders each text as one user message through the chat template before tokenizing, as
  sentence-transformers encodes it: the message format (`flat`: the text as the content; `structured`: one text
  part) and the saved `processing_kwargs.chat_template` go into the ModelConfig (`embedding_messages`,
  `embedding_template_kwargs`), so an artifact renders texts the same way (`text_ids`). Size kwargs (truncation,
  "max_length", padding) are not kept: an input is never truncated, one past the model's bound is refused.
- The task is resolved once, before anything is built: `resolve_task` returns the ModelConfig a compile or a load
  builds (pooling set for embeddings, None for generation), so everything downstream (the model class, its
  weight names, the compile-cache key, the manifest) follows from the config alone.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from neuron_opt.architectures import is_bare_model
from neuron_opt.config import POOLING_MODES, ModelConfig
from neuron_opt.errors import ConfigError
from neuron_opt.headers import read_json_capped

TASKS = ("generate", "embed")
MODULES = "modules.json"
# module types by class name: sentence-transformers has moved them between packages (models.Transformer,
# base.modules.transformer.Transformer, ...); the class names stayed
_TRANSFORMER, _POOLING, _NORMALIZE = "Transformer", "Pooling", "Normalize"
# the Pooling config's modes (`pooling_mode`: a name or a list; older files: one `pooling_mode_<name>` flag each)
# -> our pooling; every other mode is refused
_ST_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
MESSAGE_FORMATS = ("flat", "structured")
# apply_chat_template's size and output arguments, and sentence-transformers' own flag for restoring a truncated
# render's suffix: none changes an input that is not truncated, and we never truncate
_SIZE_KWARGS = frozenset({"padding", "truncation", "max_length", "return_tensors", "restore_suffix"})
_ST_LEGACY = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean",
              "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
              "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
              "pooling_mode_weightedmean_tokens": "weightedmean"}

@dataclasses.dataclass(frozen=True)
class SentenceTransformerSpec:
    """What a sentence-transformers checkpoint declares: its pooling mode and whether it normalises."""

    pooling: str
    normalize: bool
    messages: str | None = None  # MESSAGE_FORMATS: texts go through the chat template first; None: tokenized as is
    template_kwargs: str = ""  # apply_chat_template's keyword arguments then, a JSON object ("": none)


def _read_json(path: Path) -> Any:
    return read_json_capped(path, ConfigError, "sentence-transformers")


def read_sentence_transformers(root: Path) -> SentenceTransformerSpec | None:
    """The pooling a checkpoint directory's sentence-transformers files declare; None without `modules.json`.
    ConfigError naming the file and field for a pipeline we do not compute exactly."""
    root = Path(root)
    if not (root / MODULES).is_file():
        return None
    modules = _read_json(root / MODULES)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ConfigError(f"{root / MODULES}: expected a list of module objects")
    types = [str(m.get("type", "")) for m in modules]
    names = [t.rpartition(".")[2] if t.startswith("sentence_transformers.") else t for t in types]
    if len(modules) not in (2, 3) or names[:2] != [_TRANSFORMER, _POOLING] or names[2:] not in ([], [_NORMALIZE]):
        raise ConfigError(f"{root / MODULES}: modules {types}; supported: Transformer, Pooling and optionally "
                          "Normalize, in that order (no Dense or other modules)", param="modules")
    if str(modules[0].get("path", "")) not in ("", "."):
        raise ConfigError(f"{root / MODULES}: the Transformer module must be the checkpoint directory itself "
                          f"(path ''), got {modules[0].get('path')!r}", param="modules")
    bert = root / "sentence_bert_config.json"  # the Transformer module's: how it turns a text into tokens
    messages, template_kwargs = _message_modality(bert, _read_json(bert) if bert.is_file() else {})
    pool_dir = str(modules[1].get("path", ""))
    if not pool_dir or Path(pool_dir).name != pool_dir:
        raise ConfigError(f"{root / MODULES}: the Pooling module's path {pool_dir!r} is not a subdirectory name")
    cfg_file = root / pool_dir / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{cfg_file}: missing (the Pooling module's config)")
    pool = _read_json(cfg_file)
    if not isinstance(pool, dict):
        raise ConfigError(f"{cfg_file}: expected a JSON object")
    mode = pool.get("pooling_mode", [m for k, m in _ST_LEGACY.items() if pool.get(k)])
    modes = [mode] if isinstance(mode, str) else list(mode) if isinstance(mode, list) else [mode]
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ConfigError(f"{cfg_file}: pooling mode {mode!r}; supported: exactly one of {', '.join(_ST_MODES)}",
                          param="pooling_mode")
    if pool.get("include_prompt", True) is False:
        raise ConfigError(f"{cfg_file}: include_prompt false (a mean that leaves out an instruction prefix) is not "
                          "supported", param="include_prompt")
    return SentenceTransformerSpec(_ST_MODES[modes[0]], len(modules) == 3, messages, template_kwargs)


def _message_modality(bert: Path, cfg: Any) -> tuple[str | None, str]:
    """The Transformer module's message format and chat-template kwargs as a JSON object (None, "" without the
    `message` modality)."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{bert}: expected a JSON object")
    modality = cfg.get("modality_config") or {}
    if not isinstance(modality, dict):
        raise ConfigError(f"{bert}: modality_config must be an object", param="modality_config")
    if "message" not in modality:
        return None, ""
    entry = modality["message"] if isinstance(modality["message"], dict) else {}
    fmt = entry.get("format")
    if fmt not in MESSAGE_FORMATS:
        raise ConfigError(f"{bert}: modality_config.message.format {fmt!r}; supported: {', '.join(MESSAGE_FORMATS)} "
                          "(sentence-transformers >= 6 saves the one it inferred)", param="modality_config")
    processing = cfg.get("processing_kwargs") or {}
    chat = processing.get("chat_template") or {} if isinstance(processing, dict) else None
    if not isinstance(chat, dict) or not all(isinstance(k, str) for k in chat):
        raise ConfigError(f"{bert}: processing_kwargs.chat_template must be an object", param="processing_kwargs")
    kwargs = {k: v for k, v in chat.items() if k not in _SIZE_KWARGS}
    if "tokenize" in kwargs or "return_dict" in kwargs:
        raise ConfigError(f"{bert}: processing_kwargs.chat_template may not set tokenize or return_dict",
                          param="processing_kwargs")
    return fmt, json.dumps(kwargs, sort_keys=True) if kwargs else ""


def text_ids(cfg: ModelConfig | None, tokenizer: Any, text: str) -> list[int]:
    """An embedding input's token ids as sentence-transformers makes them: the text with the tokenizer's special
    tokens, or (a checkpoint with the `message` modality) the text as one user message rendered through the chat
    template with the checkpoint's kwargs."""
    messages = getattr(cfg, "embedding_messages", None)  # a runner built without its ModelConfig: as they are
    if messages is None:
        return list(tokenizer(text)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the model renders embedding inputs through the chat template (sentence-transformers' "
                          "message modality), but its tokenizer has none", param="chat_template")
    content: Any = text if messages == "flat" else [{"type": "text", "text": text}]
    kwargs = json.loads(cfg.embedding_template_kwargs) if cfg.embedding_template_kwargs else {}
    out = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=True, return_dict=True,
                                        **kwargs)
    return list(out["input_ids"])


def resolve_task(cfg: ModelConfig, task: str | None = None, pooling: str | None = None,
                 normalize: bool | None = None, matryoshka_dims: tuple[int, ...] | None = None) -> ModelConfig:
    """The config a compile (or a checkpoint load) builds for `task`.

    `task` None: "embed" when `cfg` already pools (a sentence-transformers checkpoint) or names a bare decoder,
    else "generate". For "embed", `pooling` / `normalize` / `matryoshka_dims` override the checkpoint's (a
    checkpoint without sentence-transformers files needs `pooling`; `normalize` defaults to on then). For
    "generate", the overrides are refused, and so is a bare decoder (it has no LM head)."""
    bare = is_bare_model(cfg.architecture)
    if task is None:
        task = "embed" if (cfg.is_embedding or bare or pooling is not None) else "generate"
    if task not in TASKS:
        raise ConfigError(f"task: must be one of {', '.join(TASKS)}, got {task!r}", param="task")
    if task == "generate":
        if pooling is not None or normalize is not None or matryoshka_dims:
            raise ConfigError("pooling/normalize/matryoshka_dims: only for --task embed", param="task")
        if bare:
            raise ConfigError(f"task: {cfg.architecture} is a bare decoder without an LM head; it can only be "
                              "compiled as an embedding model (--task embed)", param="task")
        return dataclasses.replace(cfg, pooling=None, normalize_embeddings=False, matryoshka_dims=(),
                                   embedding_messages=None, embedding_template_kwargs="")
    mode = pooling if pooling is not None else cfg.pooling
    if mode is None:
        raise ConfigError(f"pooling: {cfg.architecture} declares no pooling (no sentence-transformers "
                          f"modules.json); choose one with --pooling {'|'.join(POOLING_MODES)}", param="pooling")
    norm = normalize if normalize is not None else (cfg.normalize_embeddings if cfg.is_embedding else True)
    dims = tuple(sorted(set(matryoshka_dims))) if matryoshka_dims is not None else cfg.matryoshka_dims
    return dataclasses.replace(cfg, pooling=mode, normalize_embeddings=norm, matryoshka_dims=dims)


def with_sentence_transformers(cfg: ModelConfig, root: Path) -> ModelConfig:
    """`cfg` with the pooling that `root`'s sentence-transformers files declare (unchanged without them)."""
    spec = read_sentence_transformers(root)
    if spec is None:
        return cfg
    return dataclasses.replace(cfg, pooling=spec.pooling, normalize_embeddings=spec.normalize,
                               embedding_messages=spec.messages, embedding_template_kwargs=spec.template_kwargs)


def describe(cfg: ModelConfig) -> str:
    """One line for logs and `inspect`: the task and its pooling."""
    if not cfg.is_embedding:
        return "task generate"
    dims = f", matryoshka dims {list(cfg.matryoshka_dims)}" if cfg.matryoshka_dims else ""
    return (f"task embed: {cfg.pooling} pooling, {'L2-normalised' if cfg.normalize_embeddings else 'not normalised'}"
            f", {cfg.hidden_size} dims{dims}")
