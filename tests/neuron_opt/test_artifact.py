"""Artifacts: compile -> load -> generate round trip, atomic write, tampering refused with clear errors, manifest paths
confined to the artifact, `compile --out` replacing only an artifact, and a graph that cannot load named."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from helpers import cpu_artifact_with_graphs, eager_runner

from neuron_opt.api import LLM
from neuron_opt.artifact import MANIFEST, manifest_digest, read_manifest, sha256_file
from neuron_opt.compiler import CompileRequest, compile_artifact
from neuron_opt.config import ParallelConfig
from neuron_opt.errors import ArtifactError, ConfigError
from neuron_opt.runtime.generate import generate_ids
from neuron_opt.runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def artifact(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "tiny"
    req = CompileRequest(model=str(tiny_dir("smollm-tok")), out=out, backend="eager", max_model_len=128,
                         batch_size=2, prefill_buckets=(16, 64), decode_buckets=(32, 128), use_cache=False)
    compile_artifact(req, log=lambda s: None, progress=False)
    return out


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_artifact_generates_like_the_eager_checkpoint(artifact, tiny_dir):
    llm = LLM(artifact)
    ref_runner = eager_runner(tiny_dir("smollm-tok"), max_model_len=128)
    prompt = llm.tokenizer("Hello there, how are you?")["input_ids"]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ref = generate_ids(ref_runner, llm.tokenizer, prompt, params, ())
    assert llm.generate_ids(prompt, params).token_ids == ref.token_ids


def test_manifest_lists_every_file_with_sha256(artifact):
    raw = json.loads((artifact / MANIFEST).read_text())
    assert "weights/rank0.safetensors" in raw["files"]
    assert raw["kv_geometry"]["num_blocks"] == 2 * 128 // 32 + 1 and raw["kv_geometry"]["max_model_len"] == 128
    assert {"neuron_opt", "torch", "transformers"} <= set(raw["versions"])
    assert not list(artifact.parent.glob(".tiny.tmp-*")), "temporary directory left behind"
    # the geometry's layout names the block pool's dimensions in the order the executor allocates them
    geo, loaded = raw["kv_geometry"], LLM(artifact)
    names = geo["layout"].strip("[]").split(", ")
    assert tuple(geo[n] for n in names) == tuple(loaded.runner.executor.k_caches[0].shape)


def test_flipped_byte_in_weights_is_refused(artifact, tmp_path):
    art = _copy(artifact, tmp_path / "a")
    w = art / "weights" / "rank0.safetensors"
    data = bytearray(w.read_bytes())
    data[len(data) // 2] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"rank0.safetensors: sha256 does not match"):
        read_manifest(art)


def test_edited_config_is_refused(artifact, tmp_path):
    art = _copy(artifact, tmp_path / "a")
    raw = json.loads((art / MANIFEST).read_text())
    raw["model"]["rms_norm_eps"] = 0.5
    (art / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match="manifest was edited"):
        read_manifest(art)


def test_different_kv_geometry_is_refused(artifact, tmp_path):
    art = _copy(artifact, tmp_path / "a")
    raw = json.loads((art / MANIFEST).read_text())
    raw["kv_geometry"]["max_model_len"] = 4096
    raw["digest"] = manifest_digest(raw)
    (art / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match=r"KV geometry.*max_model_len.*\(4096, 128\)"):
        read_manifest(art)


def test_other_torch_version_is_refused(artifact, tmp_path):
    art = _copy(artifact, tmp_path / "a")
    raw = json.loads((art / MANIFEST).read_text())
    raw["versions"]["torch"] = "2.0.0"
    raw["digest"] = manifest_digest(raw)
    (art / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match=r"compiled with torch 2.0.0.*recompile"):
        read_manifest(art)


def test_missing_and_extra_files_are_refused(artifact, tmp_path):
    art = _copy(artifact, tmp_path / "a")
    (art / "weights" / "rank0.safetensors").unlink()
    with pytest.raises(ArtifactError, match="missing file"):
        read_manifest(art)
    art2 = _copy(artifact, tmp_path / "b")
    (art2 / "weights" / "evil.bin").write_bytes(b"x")
    with pytest.raises(ArtifactError, match="not listed"):
        read_manifest(art2)


def test_not_an_artifact(tmp_path):
    with pytest.raises(ArtifactError, match="not an artifact"):
        read_manifest(tmp_path)


def test_failed_compile_leaves_no_partial_artifact(tiny_dir, tmp_path):
    out = tmp_path / "never"
    req = CompileRequest(model=str(tiny_dir("smollm-tok")), out=out, backend="eager", max_model_len=128,
                         prefill_buckets=(16, 256), use_cache=False)
    with pytest.raises(Exception, match="prefill_buckets"):
        compile_artifact(req, log=lambda s: None, progress=False)
    assert not out.exists() and not list(tmp_path.glob(".never*"))


@pytest.mark.parametrize("kwargs, field", [
    (dict(dtype="bfloat16"), "dtype"), (dict(max_model_len=256), "max_model_len"), (dict(batch_size=4), "batch_size"),
    (dict(parallel=ParallelConfig(tp=2)), "parallel"),
])
def test_llm_refuses_settings_an_artifact_fixed_otherwise(artifact, kwargs, field):
    with pytest.raises(ConfigError, match=f"{field}: this artifact was compiled with") as e:
        LLM(artifact, **kwargs)
    assert e.value.param == field and "recompile" in str(e.value)


def test_llm_accepts_an_artifacts_own_settings(artifact):
    llm = LLM(artifact, dtype="float32", max_model_len=128, batch_size=2, parallel=ParallelConfig())
    assert llm.runner.cache.max_batch == 2


@pytest.mark.parametrize("flags, needle", [
    (["--dtype", "bfloat16"], "dtype: this artifact was compiled with"),
    (["--max-model-len", "64"], "max_model_len: this artifact was compiled with"),
    (["--max-num-seqs", "8"], "--max-num-seqs: 8 exceeds the artifact's largest decode batch (2)"),
])
def test_serve_refuses_flags_an_artifact_fixed_otherwise(artifact, flags, needle, capsys):
    from neuron_opt.cli import main

    assert main(["serve", str(artifact), "--port", "0", *flags]) == 2
    assert needle in capsys.readouterr().err


def _forge(art, edit):
    """Edit the manifest with `edit(raw)`, then recompute every file's sha256 and the digest, as a forger would."""
    raw = json.loads((art / MANIFEST).read_text())
    edit(raw)
    raw["files"] = {str(p.relative_to(art)): sha256_file(p) for p in sorted(art.rglob("*"))
                    if p.is_file() and p.name != MANIFEST}
    raw["digest"] = manifest_digest(raw)
    (art / MANIFEST).write_text(json.dumps(raw))
    return art


@pytest.mark.parametrize("path", ["../outside/evil.so", "/tmp/evil.so", "graphs/../../evil.so"])
def test_graph_path_outside_the_artifact_is_refused(artifact, tmp_path, path):
    """A graph the backend would load from outside the artifact (digest recomputed, no signature asked for)."""
    art = _forge(_copy(artifact, tmp_path / "a"), lambda raw: raw["graphs"].update({"prefill_b1_s16": [path]}))
    with pytest.raises(ArtifactError, match=r"graphs\['prefill_b1_s16'\] names .*not a relative path inside"):
        read_manifest(art)


def test_graph_not_among_the_files_is_refused(artifact, tmp_path):
    art = _forge(_copy(artifact, tmp_path / "a"),
                 lambda raw: raw["graphs"].update({"prefill_b1_s16": ["graphs/rank0/unlisted.so"]}))
    with pytest.raises(ArtifactError, match="which is not one of the artifact's files"):
        read_manifest(art)


def test_file_listed_with_dotdot_or_absolute_is_refused(artifact, tmp_path):
    art = _copy(artifact, tmp_path / "a")
    raw = json.loads((art / MANIFEST).read_text())
    raw["files"]["/etc/hostname"] = raw["files"].pop("weights/rank0.safetensors")
    raw["digest"] = manifest_digest(raw)
    (art / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match=r"files names '/etc/hostname'"):
        read_manifest(art)


def test_symlink_out_of_the_artifact_is_refused_even_with_matching_hashes(artifact, tmp_path):
    """weights/ replaced by a symlink to a copy outside: every sha256 still matches the manifest."""
    art = _copy(artifact, tmp_path / "a")
    shutil.copytree(art / "weights", tmp_path / "elsewhere")
    shutil.rmtree(art / "weights")
    os.symlink(tmp_path / "elsewhere", art / "weights")
    with pytest.raises(ArtifactError, match=r"weights/rank0.safetensors: resolves to .*elsewhere.*outside the "
                                            r"artifact"):
        read_manifest(art)
    (art / "weights").unlink()
    (art / "weights").mkdir()
    os.symlink(tmp_path / "elsewhere" / "rank0.safetensors", art / "weights" / "rank0.safetensors")
    with pytest.raises(ArtifactError, match="outside the artifact"):
        read_manifest(art)


def test_symlink_inside_the_artifact_is_accepted(artifact, tmp_path):
    art = _copy(artifact, tmp_path / "a")
    (art / "weights" / "rank0.safetensors").rename(art / "tokenizer" / "w.safetensors")
    os.symlink("../tokenizer/w.safetensors", art / "weights" / "rank0.safetensors")
    _forge(art, lambda raw: None)
    read_manifest(art)


def test_draft_outside_the_artifact_is_refused(artifact, tmp_path):
    art = _forge(_copy(artifact, tmp_path / "a"), lambda raw: raw.update(draft="../other"))
    with pytest.raises(ArtifactError, match=r"draft names '../other'"):
        read_manifest(art)


def _compile_to(tiny_dir, out, **kw):
    req = CompileRequest(model=str(tiny_dir("smollm-tok")), out=out, backend="eager", max_model_len=128,
                         prefill_buckets=(16,), decode_buckets=(128,), use_cache=False, **kw)
    return compile_artifact(req, log=lambda s: None, progress=False)


def test_compile_out_onto_a_directory_that_is_not_an_artifact_is_refused(tiny_dir, tmp_path, capsys):
    """A non-empty directory that is not an artifact (a web app's manifest.json does not make it one) is kept, file
    for file; --force replaces it; an artifact is replaced without --force."""
    from neuron_opt.cli import main

    out = tmp_path / "project"
    (out / "src").mkdir(parents=True)
    (out / "src" / "main.py").write_text("print('mine')\n")
    (out / "manifest.json").write_text('{"name": "my web app"}')
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=r"--out .*project: a non-empty directory that is not an artifact.*--force"):
        _compile_to(tiny_dir, out)
    argv = ["compile", "--model", str(tiny_dir("smollm-tok")), "--out", str(out), "--backend", "eager",
            "--max-model-len", "128", "--prefill-buckets", "16", "--decode-buckets", "128", "--no-cache"]
    assert main(argv) == 2 and "--force" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert not list(tmp_path.glob(".project*"))
    assert main([*argv, "--force"]) == 0
    first = read_manifest(out)
    assert not (out / "src").exists()
    _compile_to(tiny_dir, out, prefill_batch=1)  # an artifact: replaced
    assert read_manifest(out).files == first.files
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        _compile_to(tiny_dir, tmp_path / "file", force=True)


def test_compile_into_an_empty_directory(tiny_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    _compile_to(tiny_dir, tmp_path / "empty")
    read_manifest(tmp_path / "empty")


@pytest.mark.parametrize("so_bytes", [b"\x7fELF" + b"\0" * 60, b""], ids=["corrupt", "empty"])
def test_graph_that_cannot_load_is_an_artifact_error_naming_it(artifact, tmp_path, so_bytes):
    art = cpu_artifact_with_graphs(artifact, tmp_path / "cpu", so_bytes)
    with pytest.raises(ArtifactError, match=r"graphs/rank0/cpu/layer_\w+\.so: cannot be loaded as a compiled graph"):
        LLM(art)


def test_a_compile_that_cannot_write_leaves_no_half_artifact(tiny_dir, tmp_path):
    """A write that fails mid-compile (here RLIMIT_FSIZE: write() raises EFBIG past 1 MiB, the same OSError path a
    full disk's ENOSPC takes) leaves the artifact that was there untouched and no temporary directory behind."""
    import resource
    import signal
    import subprocess
    import sys

    from helpers import compile_tiny_eager

    out = compile_tiny_eager(tiny_dir, tmp_path / "art")
    before = {p.name: sha256_file(p) for p in out.rglob("*") if p.is_file()}

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of the process being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    argv = [sys.executable, "-m", "neuron_opt.cli", "compile", "--model", str(tiny_dir("smollm-tok")), "--backend",
            "eager", "--max-model-len", "128", "--prefill-buckets", "16", "--decode-buckets", "128", "--no-cache",
            "--out", str(out), "--force"]
    r = subprocess.run(argv, preexec_fn=small_files, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode != 0 and "File too large" in r.stdout + r.stderr, r.stdout + r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["art"]
    assert {p.name: sha256_file(p) for p in out.rglob("*") if p.is_file()} == before
