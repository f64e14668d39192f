"""Hugging Face Hub ids -> local paths, through `huggingface_hub` (its cache, token, offline mode, progress bars).

A model spec is a local path (an HF directory, a .gguf file, an artifact), "default", or a Hub id: `org/name`,
or llama.cpp's `org/name:QUANT` for a GGUF repo (the one .gguf whose name carries QUANT, e.g. `Q4_K_M`).

Design decisions
- A spec that exists on disk, or "default", is never sent to the Hub; a spec shaped like neither a path that
  exists nor `org/name[:QUANT]` is left to the checkpoint reader, which says it does not exist. `--revision` and
  `--gguf-file` apply to Hub ids only: given with a local path they are refused, never ignored.
- Everything goes through `huggingface_hub` (never hand-written HTTP), so its environment holds: HF_TOKEN (gated
  and private repos), HF_HOME / HF_HUB_CACHE (the cache shared with transformers and vLLM), HF_HUB_OFFLINE=1 (the
  cache only; also used when the Hub cannot be reached), HF_ENDPOINT.
- The repo's file list is read first (from the Hub, or offline from the cached snapshot) and decides what is
  fetched: an HF checkpoint's config, tokenizer and chat template files, generation config, sentence-transformers
  files and `model.safetensors` (or its index and shards); for a GGUF repo one .gguf. Nothing else is downloaded
  (no `.bin` twins, no other quantizations), and a repo with only pickle weights (.bin/.pt/.pth) is refused from
  its file list, before any download, as a local directory of them is.
- huggingface_hub's errors become CheckpointError / ConfigError naming the id and the way out (a token, access to
  a gated repo, the revision, going online once).
- huggingface_hub (0.6 s to import) is imported in the functions that use it: the CLI's parser imports this module
  (the commands' flags and `lora.adapter`) and parses without it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path, PurePosixPath

from neuron_opt.errors import CheckpointError, ConfigError

# `org/name` with the Hub's name characters, and llama.cpp's optional `:QUANT` tag
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<tag>[\w.-]+))?")
_PICKLE = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
# an HF checkpoint's files besides its weights (root-level names, huggingface_hub's fnmatch patterns)
_HF_FILES = ["config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
             "vocab.*", "merges.txt", "chat_template*", "modules.json", "sentence_bert_config.json",
             "config_sentence_transformers.json", "*/config.json"]
_HF_WEIGHTS = ["model.safetensors", "model.safetensors.index.json"]
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]
_MAX_INDEX_BYTES = 64 << 20  # a safetensors index lists names only: a few MB for the largest checkpoints


def hub_id(spec: str | Path) -> tuple[str, str | None] | None:
    """(repo id, QUANT tag or None) when `spec` names a Hub repo; None for "default", a path that exists, or
    anything not shaped `org/name[:QUANT]`."""
    text = str(spec)
    if text == "default" or Path(text).exists():
        return None
    m = _HUB_ID.fullmatch(text)
    if m is None or ".." in m["repo"] or m["repo"].endswith((".", "-")):
        return None
    return m["repo"], m["tag"]


def resolve_model(spec: str | Path, *, revision: str | None = None, gguf_file: str | None = None,
                  config_only: bool = False, param: str = "model") -> str:
    """The local path of the model `spec` names: itself for "default" and local paths; for a Hub id, its snapshot
    directory in the Hub cache (an HF checkpoint) or the chosen .gguf file in it, fetched first if missing.
    `config_only`: an HF checkpoint's config.json alone (the planner's need), not its weights or tokenizer."""
    parsed = hub_id(spec)
    if parsed is None:
        for name, value in (("revision", revision), ("gguf_file", gguf_file)):
            if value is not None:
                raise ConfigError(f"{name}: {value!r} selects from a Hugging Face Hub repo, and {param} {spec!r} is "
                                  "not a Hub id (org/name); leave it out for a local path", param=name)
        return str(spec)
    repo, tag = parsed
    if tag is not None and gguf_file is not None:
        raise ConfigError(f"gguf_file: {spec!r} already names a quantization (:{tag}); give --gguf-file or the "
                          ":QUANT tag, not both", param="gguf_file")
    files, cached = _repo_files(repo, revision)
    try:
        patterns, gguf = needed_files(repo, files, tag, gguf_file, config_only)
    except CheckpointError as e:
        if not cached:
            raise
        raise CheckpointError(f"{e} [the files of the cached snapshot: the Hub was not asked (HF_HUB_OFFLINE, or "
                              "unreachable); fetch the model online once]") from None
    folder = Path(_download(repo, revision, patterns, cached))
    if gguf is not None:
        return str(folder / gguf)
    if shards := ([] if config_only else _index_shards(repo, folder, files)):
        folder = Path(_download(repo, revision, shards, cached))
    return str(folder)


def needed_files(repo: str, files: list[str], tag: str | None = None, gguf_file: str | None = None,
                 config_only: bool = False) -> tuple[list[str], str | None]:
    """(snapshot_download's allow_patterns for what the model needs of the repo's `files`, the .gguf among them
    or None for an HF checkpoint); CheckpointError / ConfigError for a repo or a choice we cannot load."""
    gguf = _choose_gguf(repo, files, tag, gguf_file)
    if gguf is not None:
        return [gguf], gguf
    _check_weights(repo, files)
    return (["config.json"] if config_only else _HF_FILES + _HF_WEIGHTS), None


def resolve_adapter(spec: str | Path) -> str:
    """A PEFT LoRA adapter's local directory: `spec` itself when it is a local path, else the adapter_config.json
    and adapter_model.safetensors of the Hub repo's main revision, fetched into the Hub cache when missing."""
    parsed = hub_id(spec)
    if parsed is None or parsed[1] is not None:
        return str(spec)
    repo, revision = parsed[0], None
    files, cached = _repo_files(repo, revision)
    if "adapter_model.safetensors" not in files and any(f.endswith(_PICKLE) for f in files):
        raise ConfigError(f"lora adapter {repo}: the repo holds pickle weights only (adapter_model.bin), which are "
                          "never loaded; an adapter saved with safe_serialization has adapter_model.safetensors",
                          param="lora_path")
    return _download(repo, revision, ADAPTER_FILES, cached)


def resolve_eagle3_head(spec: str | Path) -> str:
    """An EAGLE-3 head's local directory: `spec` itself when it is a local path, else the config.json and
    safetensors weights of the Hub repo's main revision, fetched into the Hub cache when missing."""
    parsed = hub_id(spec)
    if parsed is None or parsed[1] is not None:
        return str(spec)
    repo = parsed[0]
    files, cached = _repo_files(repo, None)
    _check_weights(repo, files)
    folder = Path(_download(repo, None, ["config.json", *_HF_WEIGHTS], cached))
    if shards := _index_shards(repo, folder, files):
        folder = Path(_download(repo, None, shards, cached))
    return str(folder)


def _index_shards(repo: str, folder: Path, files: list[str]) -> list[str]:
    """The shard files a sharded checkpoint's index (fetched into `folder`) names, when the repo has no
    model.safetensors; [] otherwise. Shards the repo lacks are left to the checkpoint reader, which names them."""
    index = folder / "model.safetensors.index.json"
    if "model.safetensors" in files or not index.is_file():
        return []
    if index.stat().st_size > _MAX_INDEX_BYTES:
        raise CheckpointError(f"checkpoint {repo}: {index.name} is {index.stat().st_size} bytes, more than an index "
                              f"may be ({_MAX_INDEX_BYTES >> 20} MiB)")
    try:
        names = set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {repo}: {index.name} is not a safetensors index ({e!r})") from None
    return sorted(n for n in names if isinstance(n, str) and n in files)


def _check_weights(repo: str, files: list[str]) -> None:
    """Refuse a repo without weights we read (safetensors or GGUF), naming what it holds instead."""
    if "model.safetensors" in files or "model.safetensors.index.json" in files:
        return
    if pickles := sorted(f for f in files if f.endswith(_PICKLE)):
        raise CheckpointError(f"checkpoint {repo}: the repo's weights are pickle files only ({', '.join(pickles[:3])}),"
                              " which are never unpickled; we read safetensors and GGUF only. Use a repo that ships "
                              "model.safetensors, or convert: `AutoModelForCausalLM.from_pretrained(d)"
                              ".save_pretrained(d, safe_serialization=True)`")
    raise CheckpointError(f"checkpoint {repo}: the repo has neither model.safetensors (or its index) nor a .gguf "
                          f"file (files: {', '.join(sorted(files)[:8]) or 'none'})")


def _choose_gguf(repo: str, files: list[str], tag: str | None, gguf_file: str | None) -> str | None:
    """The one .gguf to fetch: `gguf_file` (a path in the repo, or its file name), the file whose name carries the
    QUANT `tag` (between separators, any case; mmproj projector files skipped), or the repo's only .gguf when it has
    no safetensors; None for an HF checkpoint. ConfigError when a name or tag matches no file or several."""
    ggufs = sorted(f for f in files if f.endswith(".gguf") and "mmproj" not in PurePosixPath(f).name.lower())
    listing = ", ".join(ggufs) or "none"
    if gguf_file is not None:
        hits = [f for f in ggufs if gguf_file in (f, PurePosixPath(f).name)]
        what, param = f"--gguf-file {gguf_file}", "gguf_file"
    elif tag is not None:
        pattern = re.compile(rf"(?:^|[-._]){re.escape(tag)}(?:[-._]|$)", re.IGNORECASE)
        hits = [f for f in ggufs if pattern.search(PurePosixPath(f).name.removesuffix(".gguf"))]
        what, param = f"the tag :{tag}", "model"
    else:
        if "model.safetensors" in files or "model.safetensors.index.json" in files or not ggufs:
            return None
        if len(ggufs) == 1:
            return ggufs[0]
        raise ConfigError(f"model: {repo} holds {len(ggufs)} .gguf files ({listing}); choose one with "
                          f"{repo}:QUANT (e.g. :Q4_K_M) or --gguf-file NAME", param="gguf_file")
    if len(hits) == 1:
        return hits[0]
    if not hits:
        raise ConfigError(f"{param}: {what} matches no .gguf file of {repo} (its .gguf files: {listing})", param=param)
    raise ConfigError(f"{param}: {what} matches {len(hits)} .gguf files of {repo} ({', '.join(hits)}); name one "
                      "with --gguf-file", param=param)


def _offline() -> bool:
    from huggingface_hub import constants  # here: the CLI parses without it (module docstring)

    return bool(constants.HF_HUB_OFFLINE)


def _repo_files(repo: str, revision: str | None) -> tuple[list[str], bool]:
    """(the repo's file paths at `revision`, whether they come from the cache): listed by the Hub, or, offline or
    when the Hub cannot be reached, from the revision's cached snapshot."""
    import httpx2  # here: the CLI parses without it (module docstring)
    from huggingface_hub import HfApi, get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError, OfflineModeIsEnabled

    if not _offline():
        try:
            return HfApi().list_repo_files(repo, revision=revision), False
        except (OfflineModeIsEnabled, httpx2.ConnectError, httpx2.TimeoutException):
            pass  # the cache's snapshot, as snapshot_download falls back to
        except Exception as e:
            raise hub_error(e, repo, revision) from e
    folder = Path(_download(repo, revision, [], cached=True))  # no pattern: the snapshot folder, nothing checked
    try:  # the repo's whole listing, cached by the download that fetched the snapshot
        return [f.path for f in get_cached_repo_tree(repo, revision=revision)], True
    except CachedRepoTreeNotFoundError:  # a snapshot written without one: the files it holds
        return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()), True


def _download(repo: str, revision: str | None, patterns: list[str], cached: bool) -> str:
    """huggingface_hub's snapshot_download of the files `patterns` match (its progress bars, its cache)."""
    from huggingface_hub import snapshot_download  # here: the CLI parses without it (module docstring)

    try:
        return snapshot_download(repo, revision=revision, allow_patterns=patterns, local_files_only=cached)
    except Exception as e:
        raise hub_error(e, repo, revision) from e


def _cached_refs(repo: str) -> str:
    """"; cached: <its refs>" for a repo the cache holds (a revision asked for that it lacks), else ""."""
    from huggingface_hub import constants  # here: the CLI parses without it (module docstring)
    from huggingface_hub.file_download import repo_folder_name

    refs = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model") / "refs"
    names = sorted(p.relative_to(refs).as_posix() for p in refs.rglob("*") if p.is_file()) if refs.is_dir() else []
    return f"; it holds revisions {', '.join(names)} of it" if names else ""


def hub_source(spec: str | Path, revision: str | None, local: str) -> dict[str, str] | None:
    """Where a model resolved from the Hub came from, for an artifact's manifest: the id as given, the revision
    asked for and the commit its files are from (the snapshot directory's name); None for a local spec."""
    from huggingface_hub import constants  # here: the CLI parses without it (module docstring)
    from huggingface_hub.file_download import repo_folder_name

    parsed = hub_id(spec)
    if parsed is None:
        return None
    snapshots = Path(constants.HF_HUB_CACHE).resolve() / repo_folder_name(repo_id=parsed[0], repo_type="model")
    commit = Path(os.path.abspath(local)).relative_to(snapshots / "snapshots").parts[0]  # a .gguf's link kept
    return {"id": str(spec), "revision": revision or "main", "commit": commit}


def hub_error(e: Exception, repo: str, revision: str | None) -> Exception:
    """huggingface_hub's exception `e`, raised for `repo` at `revision`, as our error naming the id and what to do;
    anything else comes back unchanged."""
    from huggingface_hub import constants, get_token  # here: the CLI parses without it (module docstring)
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision is not None else ""
    if isinstance(e, GatedRepoError):  # before RepositoryNotFoundError, its base class
        how = ("set HF_TOKEN to a token of an account granted access" if get_token() is None else
               "HF_TOKEN's account has not been granted access (or the token lacks read access to gated repos)")
        return CheckpointError(f"checkpoint {repo}: a gated repo; request access at "
                               f"{constants.ENDPOINT}/{repo}, then {how}")
    if isinstance(e, RevisionNotFoundError):
        return ConfigError(f"revision: {repo} has no revision {revision!r} (a branch, tag or commit hash)",
                           param="revision")
    if isinstance(e, RepositoryNotFoundError):
        token = ("no token is set" if get_token() is None else
                 "the token set (HF_TOKEN) cannot see it: check the id and the token's access")
        return CheckpointError(f"checkpoint {repo}: no such repo on {constants.ENDPOINT}, nor a local path (a private "
                               f"repo needs HF_TOKEN set to a token that can read it; {token})")
    if isinstance(e, LocalEntryNotFoundError):
        why = "HF_HUB_OFFLINE is set" if _offline() else "the Hub could not be reached"
        what = ("its cached snapshot lacks files this model needs" if isinstance(e, IncompleteSnapshotError) else
                f"not in the Hub cache ({constants.HF_HUB_CACHE}{_cached_refs(repo)})")
        return CheckpointError(f"checkpoint {repo}{at}: {what}, and {why}; fetch it once online (any neuron-opt "
                               f"command with this id, or `hf download {repo}`), or give a local path")
    if isinstance(e, HfHubHTTPError):
        status = e.response.status_code if e.response is not None else "?"
        return CheckpointError(f"checkpoint {repo}{at}: the Hub answered HTTP {status} ({str(e).splitlines()[0]})")
    return e
