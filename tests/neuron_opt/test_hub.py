"""Hub ids (neuron_opt.hub), offline against a Hub cache written here in huggingface_hub's own layout.

The cache is laid out with huggingface_hub's own functions (`repo_folder_name`, `_create_symlink`,
`_cache_commit_hash_for_specific_revision`: what `hf_hub_download` calls): `models--org--name/blobs/<hash>`,
`snapshots/<commit>/<path>` links to the blobs, `refs/<branch or tag>` holding the commit, and checked with
`scan_cache_dir`. HF_HOME points at it and HF_HUB_OFFLINE=1, so nothing reaches the network; huggingface_hub's
constants are re-read from the environment for these tests and restored after them. The errors only the Hub can
produce (gated, 404, an unknown revision online) are huggingface_hub's own exceptions, made by its
`hf_raise_for_status` from the responses the Hub sends, mapped by `hub_error`.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path

import gguf
import httpx2
import pytest
import torch
from huggingface_hub import constants, scan_cache_dir
from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.file_download import (
    _cache_commit_hash_for_specific_revision,
    _create_symlink,
    repo_folder_name,
)
from huggingface_hub.utils import filter_repo_objects, hf_raise_for_status
from peft_adapters import make_adapter
from tiny import load_hf

from neuron_opt.checkpoint import default_model_path, open_checkpoint
from neuron_opt.errors import CheckpointError, ConfigError
from neuron_opt.hub import hub_error, hub_id, needed_files, resolve_adapter, resolve_model
from neuron_opt.runtime.sampling import SamplingParams

MAIN, V2 = "a" * 40, "b" * 40  # commits: main (also tag v1) and branch v2
# files of a repo a model does not need: in its listing, never fetched (offline, asking for one fails: the download
# checks the cached snapshot against the listing)
EXTRAS = ("README.md", "pytorch_model.bin", "consolidated.safetensors", "original/consolidated.00.pth",
          "onnx/model.onnx")
SMOL = default_model_path().name  # SmolLM2-135M-Instruct.Q4_1.gguf


def put(cache: Path, repo: str, commit: str, files: dict[str, Path | bytes], refs: tuple[str, ...],
        uncached: tuple[str, ...] | None = None) -> None:
    """`files` (repo path -> a file or bytes) as commit `commit` of `repo`, with `refs` pointing at it, laid out
    as huggingface_hub lays out a download. `uncached`: also write the repo's listing, as a download does, with
    these files of the repo besides `files`, which the cache lacks (a download that skipped them)."""
    storage = cache / repo_folder_name(repo_id=repo, repo_type="model")
    if uncached is not None:
        listing = {name: TreeCacheEntry(size=len(data), blob_id=hashlib.sha1(data).hexdigest())
                   for name, data in [(n, f.read_bytes() if isinstance(f, Path) else f) for n, f in files.items()]}
        listing.update({name: TreeCacheEntry(size=1, blob_id=hashlib.sha1(name.encode()).hexdigest())
                        for name in uncached})
        write_tree_cache(str(storage), commit, listing)
    for rel, src in files.items():
        data = src.read_bytes() if isinstance(src, Path) else src
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        pointer = storage / "snapshots" / commit / rel
        pointer.parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(pointer), new_blob=False)
    for ref in refs:
        _cache_commit_hash_for_specific_revision(str(storage), ref, commit)


def files_of(d: Path) -> dict[str, Path]:
    return {p.relative_to(d).as_posix(): p for p in d.rglob("*") if p.is_file()}


def fake_gguf(path: Path, name: str) -> Path:
    """A GGUF file that is a header only (never opened as a model here)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def hub(tiny_dir, tmp_path_factory):
    """HF_HOME -> a Hub cache holding: org/tiny (main = tag v1: the 2-layer tiny checkpoint; branch v2: a 1-layer
    one), org/smol-gguf (the default model's Q4_1 file and a Q8_0 one), org/pickles (a .bin only), org/twins (two
    .gguf files of one quantization), org/adapter (a PEFT LoRA adapter). Offline."""
    home = tmp_path_factory.mktemp("hf_home")
    scratch = tmp_path_factory.mktemp("hub_files")
    cache = home / "hub"
    put(cache, "org/tiny", MAIN, files_of(tiny_dir("smollm-tok")), ("main", "v1"))
    put(cache, "org/tiny", V2, files_of(tiny_dir("smollm-tok-1layer")), ("v2",), uncached=EXTRAS)
    sharded = scratch / "sharded"
    load_hf(tiny_dir("smollm-tok")).save_pretrained(sharded, max_shard_size="4MB")
    put(cache, "org/sharded", MAIN, files_of(sharded), ("main",), uncached=EXTRAS)
    q8 = fake_gguf(scratch / "q8.gguf", "q8")
    put(cache, "org/smol-gguf", MAIN, {SMOL: default_model_path(), SMOL.replace("Q4_1", "Q8_0"): q8,
                                       "README.md": b"# smol"}, ("main",))
    put(cache, "org/pickles", MAIN, {"config.json": tiny_dir("smollm-tok") / "config.json",
                                     "pytorch_model.bin": b"not unpickled"}, ("main",))
    put(cache, "org/twins", MAIN, {"a/m.Q4_K_M.gguf": q8, "b/m-Q4_K_M.gguf": fake_gguf(scratch / "b.gguf", "b")},
        ("main",))
    # what `plan` leaves: config.json of a repo whose listing (cached by the download, as huggingface_hub does) has
    # more; and the same without the listing
    tiny = files_of(tiny_dir("smollm-tok"))
    put(cache, "org/partial", MAIN, {"config.json": tiny["config.json"]}, ("main",),
        uncached=tuple(n for n in tiny if n != "config.json"))
    put(cache, "org/partial-unlisted", MAIN, {"config.json": tiny["config.json"]}, ("main",))
    adapter = make_adapter(tiny_dir("smollm-tok"), scratch / "adapter", 4, 8, ["q_proj", "v_proj"], 1)
    put(cache, "org/adapter", MAIN, files_of(adapter), ("main",))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HOME", str(home))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.delenv("HF_HUB_CACHE", raising=False)
        mp.delenv("HF_TOKEN", raising=False)
        importlib.reload(constants)  # huggingface_hub reads its environment once, at import
        yield cache
    importlib.reload(constants)


def test_the_cache_is_huggingface_hubs_own_layout(hub):
    info = {r.repo_id: r for r in scan_cache_dir(hub).repos if r.repo_id != "org/embed"}  # added by a test below
    assert set(info) == {"org/tiny", "org/sharded", "org/smol-gguf", "org/pickles", "org/twins", "org/adapter",
                         "org/partial", "org/partial-unlisted"}
    tiny = info["org/tiny"]
    assert {r.commit_hash: set(r.refs) for r in tiny.revisions} == {MAIN: {"main", "v1"}, V2: {"v2"}}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {f.file_name for r in tiny.revisions
                                                                       for f in r.files}
    assert constants.HF_HUB_CACHE == str(hub) and constants.HF_HUB_OFFLINE


def test_compile_cli_from_a_hub_id(hub, tiny_dir, tmp_path):
    """`neuron-opt compile --model org/tiny --revision v2` compiles the cached v2 branch (the same weights as its
    local directory; its Hub id and commit in the manifest), and `--speculative-model org/tiny` the main revision
    as its draft."""
    from neuron_opt.cli import main

    out = tmp_path / "art"
    rc = main(["compile", "--model", "org/tiny", "--out", str(out), "--backend", "eager", "--max-model-len", "128",
               "--prefill-buckets", "16", "--decode-buckets", "128", "--no-cache", "--speculative-model", "org/tiny",
               "--revision", "v2", "--num-speculative-tokens", "2"])
    assert rc == 0
    source = json.loads((out / "manifest.json").read_text())["source"]
    assert source["hub"] == {"id": "org/tiny", "revision": "v2", "commit": V2}
    assert source["weights_sha256"] == open_checkpoint(tiny_dir("smollm-tok-1layer")).weights_fingerprint()
    draft = json.loads((out / "draft" / "manifest.json").read_text())["source"]  # the draft: main, from the cache
    assert draft["weights_sha256"] == open_checkpoint(tiny_dir("smollm-tok")).weights_fingerprint()


def test_a_revision_is_a_branch_a_tag_or_a_commit(hub):
    for revision, commit, layers in (("v2", V2, 1), ("v1", MAIN, 2), (MAIN, MAIN, 2), (V2, V2, 1), (None, MAIN, 2)):
        path = Path(resolve_model("org/tiny", revision=revision))
        assert path.name == commit and path.parent.name == "snapshots"
        assert open_checkpoint(path).config.num_hidden_layers == layers


def test_a_sharded_checkpoint_fetches_the_shards_its_index_names(hub, tiny_dir):
    """The index first, then the shards it names; nothing of EXTRAS (the .bin twin, consolidated weights) is asked
    for, or the offline download would fail on them."""
    path = Path(resolve_model("org/sharded"))
    shards = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) > 1 and all((path / s).is_file() for s in shards)
    ckpt = open_checkpoint(path)
    local = open_checkpoint(tiny_dir("smollm-tok"))
    assert ckpt.config == local.config
    got, want = ckpt.state_dict(), local.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_an_embedding_model_from_a_hub_id(hub, tmp_path):
    """A sentence-transformers repo (saved by sentence-transformers) compiles as an embedding model from its id:
    its pooling files are fetched with it."""
    from st_models import make_st_model

    from neuron_opt.cli import main

    st, _ = make_st_model(tmp_path / "made", "qwen3", "mean", normalize=True)
    put(hub, "org/embed", MAIN, files_of(st), ("main",))
    out = tmp_path / "art"
    assert main(["compile", "--model", "org/embed", "--out", str(out), "--backend", "eager", "--max-model-len", "64",
                 "--prefill-buckets", "16", "--no-cache"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["model"]["pooling"], manifest["model"]["normalize_embeddings"]) == ("mean", True)
    assert manifest["source"]["weights_sha256"] == open_checkpoint(st).weights_fingerprint()


def test_plan_reads_the_revision_asked_for(hub, tiny_dir, capsys):
    from neuron_opt.cli import main

    def plan(*model: str) -> dict:
        main(["plan", "--model", *model, "--instance", "cpu", "--json"])
        return json.loads(capsys.readouterr().out)

    assert plan("org/tiny", "--revision", "v2") == plan(str(tiny_dir("smollm-tok-1layer")))
    assert plan("org/tiny") == plan(str(tiny_dir("smollm-tok")))


def test_llm_from_a_hub_id_equals_the_local_directory(hub, tiny_dir):
    from neuron_opt import LLM

    params = SamplingParams(max_tokens=8, temperature=0.0)
    ids = [1, 504, 3458, 282, 4649, 314]
    got = LLM("org/tiny", max_model_len=64).generate_ids(ids, params).token_ids
    assert got == LLM(str(tiny_dir("smollm-tok")), max_model_len=64).generate_ids(ids, params).token_ids
    assert LLM("org/tiny", revision="v2", max_model_len=64).config.num_hidden_layers == 1


def test_a_gguf_repo_by_quant_tag_or_file_name(hub):
    want = hub / repo_folder_name(repo_id="org/smol-gguf", repo_type="model") / "snapshots" / MAIN / SMOL
    for spec, gguf_file in (("org/smol-gguf:Q4_1", None), ("org/smol-gguf:q4_1", None), ("org/smol-gguf", SMOL)):
        path = resolve_model(spec, gguf_file=gguf_file)
        assert Path(path) == want and Path(path).read_bytes()[:4] == b"GGUF"
    ckpt = open_checkpoint(resolve_model("org/smol-gguf:Q4_1"))
    assert ckpt.format == "gguf" and ckpt.config == open_checkpoint("default").config


def test_gguf_choices_that_match_no_file_or_several(hub):
    with pytest.raises(ConfigError, match=r"Q4_K_M matches 2 \.gguf files of org/twins.*a/m\.Q4_K_M\.gguf"):
        resolve_model("org/twins:Q4_K_M")
    with pytest.raises(ConfigError, match=r":Q5_K_M matches no \.gguf file of org/smol-gguf.*Q4_1\.gguf") as e:
        resolve_model("org/smol-gguf:Q5_K_M")
    assert e.value.param == "model"
    with pytest.raises(ConfigError, match=r"--gguf-file x\.gguf matches no") as e:
        resolve_model("org/smol-gguf", gguf_file="x.gguf")
    assert e.value.param == "gguf_file"
    with pytest.raises(ConfigError, match=r"org/smol-gguf holds 2 \.gguf files.*org/smol-gguf:QUANT"):
        resolve_model("org/smol-gguf")
    with pytest.raises(ConfigError, match="not both"):
        resolve_model("org/smol-gguf:Q4_1", gguf_file=SMOL)
    assert resolve_model("org/twins", gguf_file="b/m-Q4_K_M.gguf").endswith("b/m-Q4_K_M.gguf")


def test_offline_errors_name_the_id(hub, tmp_path, capsys):
    from neuron_opt.cli import main

    with pytest.raises(CheckpointError, match=r"org/absent: not in the Hub cache .*HF_HUB_OFFLINE is set"):
        resolve_model("org/absent")
    with pytest.raises(CheckpointError, match=r"org/tiny at revision 'v3': .*revisions main, v1, v2"):
        resolve_model("org/tiny", revision="v3")
    with pytest.raises(CheckpointError, match=r"org/pickles: the repo's weights are pickle files only "
                                              r"\(pytorch_model\.bin\)"):
        resolve_model("org/pickles")
    rc = main(["compile", "--model", "org/absent", "--out", str(tmp_path / "a"), "--backend", "eager"])
    err = capsys.readouterr().err
    assert rc == 2 and "neuron-opt compile: error: checkpoint org/absent: not in the Hub cache" in err


def test_a_partly_cached_snapshot_offline(hub):
    """`plan` fetched config.json only; offline, that is enough for `plan` again, and compile names what is missing:
    from the repo's cached listing when the download left one, else from the files the snapshot holds."""
    assert (Path(resolve_model("org/partial", config_only=True)) / "config.json").is_file()
    with pytest.raises(CheckpointError, match=r"org/partial: its cached snapshot lacks files this model needs"):
        resolve_model("org/partial")
    with pytest.raises(CheckpointError, match=r"org/partial-unlisted: the repo has neither model.safetensors .*"
                                              r"\(files: config.json\) \[the files of the cached snapshot"):
        resolve_model("org/partial-unlisted")


def test_local_paths_and_default_never_reach_the_hub(hub, tiny_dir, tmp_path):
    local = str(tiny_dir("smollm-tok"))
    assert resolve_model(local) == local and resolve_model("default") == "default"
    assert hub_id("default") is None and hub_id(local) is None and hub_id("./org/name") is None
    assert hub_id("org/name:Q4_K_M") == ("org/name", "Q4_K_M") and hub_id("org/name") == ("org/name", None)
    with pytest.raises(ConfigError, match="not a Hub id") as e:
        resolve_model(local, revision="v2")
    assert e.value.param == "revision"
    with pytest.raises(ConfigError, match="not a Hub id") as e:
        resolve_model("default", gguf_file=SMOL)
    assert e.value.param == "gguf_file"


def test_a_lora_adapter_from_a_hub_id(hub, tiny_dir):
    from neuron_opt.lora.adapter import capacity_for, read_adapter
    from neuron_opt.lora.config import LoraConfig

    path = Path(resolve_adapter("org/adapter"))
    assert path.name == MAIN and {"adapter_config.json", "adapter_model.safetensors"} <= set(files_of(path))
    assert capacity_for("org/adapter") == LoraConfig(1, 4)
    cfg = open_checkpoint(tiny_dir("smollm-tok")).config
    got, local = read_adapter("org/adapter", cfg, LoraConfig(1, 8)), read_adapter(path, cfg, LoraConfig(1, 8))
    assert (got.rank, got.digest, set(got.weights)) == (4, local.digest, set(local.weights))
    with pytest.raises(ConfigError, match="org/absent-adapter: not in the Hub cache") as e:
        read_adapter("org/absent-adapter", cfg, LoraConfig(1, 8))
    assert e.value.param == "lora_path"


# What a download fetches: the patterns, filtered by huggingface_hub's own filter over real repos' file lists.
LLAMA = [".gitattributes", "LICENSE.txt", "README.md", "USE_POLICY.md", "config.json", "generation_config.json",
         "model.safetensors", "original/consolidated.00.pth", "original/params.json", "original/tokenizer.model",
         "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
SHARDED = ["LICENSE", "README.md", "config.json", "generation_config.json", "merges.txt", "vocab.json",
           "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
           "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin", "pytorch_model.bin.index.json",
           "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "consolidated.safetensors"]
EMBEDDING = [".gitattributes", "1_Pooling/config.json", "README.md", "config.json", "config_sentence_transformers.json",
             "generation_config.json", "merges.txt", "model.safetensors", "modules.json", "tokenizer.json",
             "tokenizer_config.json", "vocab.json", "onnx/model.onnx"]
GGUF_REPO = ["README.md", "Qwen_Qwen3-8B-Q4_K_M.gguf", "Qwen_Qwen3-8B-Q4_K_S.gguf", "Qwen_Qwen3-8B-Q4_K_L.gguf",
             "Qwen_Qwen3-8B-Q8_0.gguf", "Qwen_Qwen3-8B-IQ4_XS.gguf", "Qwen_Qwen3-8B.imatrix", "mmproj-Q8_0.gguf"]


@pytest.mark.parametrize("files, want", [
    (LLAMA, {"config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
             "tokenizer.json", "tokenizer_config.json"}),
    (SHARDED, {"config.json", "generation_config.json", "merges.txt", "vocab.json", "model.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}),  # then the index's shards
    (EMBEDDING, {"1_Pooling/config.json", "config.json", "config_sentence_transformers.json", "generation_config.json",
                 "merges.txt", "model.safetensors", "modules.json", "tokenizer.json", "tokenizer_config.json",
                 "vocab.json"}),
], ids=["llama", "sharded", "embedding"])
def test_only_what_the_model_needs_is_fetched(files, want):
    patterns, gguf_name = needed_files("org/x", files)
    assert gguf_name is None and set(filter_repo_objects(files, allow_patterns=patterns)) == want
    config, _ = needed_files("org/x", files, config_only=True)
    assert set(filter_repo_objects(files, allow_patterns=config)) == {"config.json"}


def test_one_gguf_of_a_repo_is_fetched():
    for tag, want in (("Q4_K_M", "Qwen_Qwen3-8B-Q4_K_M.gguf"), ("q8_0", "Qwen_Qwen3-8B-Q8_0.gguf"),
                      ("IQ4_XS", "Qwen_Qwen3-8B-IQ4_XS.gguf")):
        patterns, name = needed_files("org/x", GGUF_REPO, tag)
        assert name == want and list(filter_repo_objects(GGUF_REPO, allow_patterns=patterns)) == [want]
    with pytest.raises(ConfigError, match=r"Q4_K matches 3 \.gguf files"):
        needed_files("org/x", GGUF_REPO, "Q4_K")
    assert needed_files("org/x", ["README.md", "m-Q4_0.gguf", "mmproj-f16.gguf"])[1] == "m-Q4_0.gguf"
    with pytest.raises(CheckpointError, match="neither model.safetensors .* nor a .gguf file"):
        needed_files("org/x", ["README.md", "config.json"])


def _hub_response(status: int, url: str, code: str) -> Exception:
    """The exception huggingface_hub raises for the Hub's answer `status` with X-Error-Code `code` at `url`."""
    response = httpx2.Response(status, headers={"X-Error-Code": code, "X-Error-Message": code},
                               request=httpx2.Request("GET", url))
    with pytest.raises(Exception) as e:
        hf_raise_for_status(response)
    return e.value


def test_the_hubs_own_errors_become_ours(monkeypatch):
    """Gated without a token and with one, a repo that does not exist (404) or is private (401), an unknown
    revision: huggingface_hub's exceptions, made from the Hub's responses by its own `hf_raise_for_status`."""
    gated = _hub_response(403, "https://huggingface.co/api/models/org/gated/revision/main", "GatedRepo")
    assert isinstance(gated, GatedRepoError)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", "/nonexistent/token")
    err = hub_error(gated, "org/gated", None)
    assert isinstance(err, CheckpointError) and "org/gated: a gated repo" in str(err) and "set HF_TOKEN" in str(err)
    monkeypatch.setenv("HF_TOKEN", "hf_" + "x" * 34)
    assert "has not been granted access" in str(hub_error(gated, "org/gated", None))
    for status in (401, 404):
        missing = _hub_response(status, "https://huggingface.co/api/models/org/none/revision/main", "RepoNotFound")
        assert isinstance(missing, RepositoryNotFoundError) and not isinstance(missing, GatedRepoError)
        err = hub_error(missing, "org/none", None)
        assert isinstance(err, CheckpointError) and "org/none: no such repo" in str(err)
    revision = _hub_response(404, "https://huggingface.co/api/models/org/tiny/revision/v9", "RevisionNotFound")
    assert isinstance(revision, RevisionNotFoundError)
    err = hub_error(revision, "org/tiny", "v9")
    assert isinstance(err, ConfigError) and err.param == "revision" and "org/tiny has no revision 'v9'" in str(err)
    other = ValueError("not the Hub's")
    assert hub_error(other, "org/x", None) is other


def test_serve_names_a_hub_model_by_its_id():
    from neuron_opt.cli import build_parser
    from neuron_opt.commands.serve_engine import served_name

    for spec in ("org/tiny", "org/smol-gguf:Q4_1"):
        assert served_name(build_parser().parse_args(["serve", "--model", spec])) == spec
