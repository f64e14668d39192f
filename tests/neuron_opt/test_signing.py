"""Signed artifacts: keygen, compile --sign-key, and the trusted-keys check of LLM, generate, serve and inspect.

The forger edits a file and recomputes every sha256 and the manifest digest, so the checksums all agree (read_manifest
without trusted keys accepts the result): only the signature tells.
"""

from __future__ import annotations

import json
import stat

import pytest
from helpers import compile_tiny_eager, cpu_artifact_with_graphs

from neuron_opt import envs
from neuron_opt.api import LLM
from neuron_opt.artifact import MANIFEST, manifest_digest, read_manifest, sha256_file
from neuron_opt.cli import main
from neuron_opt.compiler import CompileRequest, compile_artifact
from neuron_opt.errors import ArtifactError, ConfigError
from neuron_opt.runtime.sampling import SamplingParams
from neuron_opt.signing import SIGNATURE, generate_keypair, load_signing_key, sign_manifest


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """{"ours": (private, public, fingerprint), "theirs": (...)}."""
    root = tmp_path_factory.mktemp("keys")
    return {name: generate_keypair(root / name) for name in ("ours", "theirs")}




@pytest.fixture(scope="module")
def signed(tiny_dir, keys, tmp_path_factory):
    return compile_tiny_eager(tiny_dir, tmp_path_factory.mktemp("signed") / "art", keys["ours"][0])


@pytest.fixture(scope="module")
def unsigned(tiny_dir, tmp_path_factory):
    return compile_tiny_eager(tiny_dir, tmp_path_factory.mktemp("unsigned") / "art")


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _forge(art):
    """Flip a byte of the weights, then recompute every sha256 and the digest; the signature is left as it was."""
    w = art / "weights" / "rank0.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF
    w.write_bytes(bytes(data))
    raw = json.loads((art / MANIFEST).read_text())
    raw["files"] = {k: sha256_file(art / k) for k in raw["files"]}
    raw["digest"] = manifest_digest(raw)
    (art / MANIFEST).write_text(json.dumps(raw, indent=2, sort_keys=True))
    return art


def test_keygen_writes_a_private_key_0600_and_never_overwrites(tmp_path, capsys):
    out = tmp_path / "k"
    assert main(["keygen", "--out", str(out)]) == 0
    assert "fingerprint: sha256:" in capsys.readouterr().out
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(out) == 0o700 and mode(out / "signing.key") == 0o600 and mode(out / "signing.pub") == 0o644
    before = (out / "signing.key").read_bytes()
    assert main(["keygen", "--out", str(out)]) == 2
    assert "signing.key exists; refusing to overwrite a key" in capsys.readouterr().err
    assert (out / "signing.key").read_bytes() == before
    (out / "signing.key").unlink()  # only the public key left: still refused, nothing written
    with pytest.raises(ConfigError, match="signing.pub exists"):
        generate_keypair(out)
    assert not (out / "signing.key").exists()


def test_a_private_key_readable_by_others_is_refused(keys, tmp_path):
    loose = tmp_path / "loose.key"
    loose.write_bytes(keys["ours"][0].read_bytes())
    loose.chmod(0o644)
    with pytest.raises(ConfigError, match=r"--sign-key: .*loose.key is readable by others \(mode 0644\).*chmod 600"):
        load_signing_key(loose)
    with pytest.raises(ConfigError, match="--sign-key: .* is not an unencrypted PEM private key"):
        load_signing_key(keys["ours"][1].parent / "signing.pub")


def test_signed_artifact_loads_with_its_key(signed, keys):
    assert (signed / SIGNATURE).is_file()
    llm = LLM(signed, trusted_keys=[keys["ours"][1]])
    assert len(llm.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True)).token_ids) == 3


def test_forged_artifact_with_every_hash_recomputed_is_refused(signed, keys, tmp_path):
    forged = _forge(_copy(signed, tmp_path / "forged"))
    read_manifest(forged, trusted_keys=())  # the checksums cannot tell
    with pytest.raises(ArtifactError, match="the signature does not match its manifest.json"):
        LLM(forged, trusted_keys=[keys["ours"][1]])


def test_forged_artifact_resigned_by_another_key_is_refused(signed, keys, tmp_path):
    forged = _forge(_copy(signed, tmp_path / "forged"))
    sign_manifest(forged, (forged / MANIFEST).read_bytes(), load_signing_key(keys["theirs"][0]))
    with pytest.raises(ArtifactError, match=f"signed by key {keys['theirs'][2]}, which is not among the trusted keys"):
        LLM(forged, trusted_keys=[keys["ours"][1]])
    LLM(forged, trusted_keys=[keys["theirs"][1], keys["ours"][1]])  # theirs, if trusted, is a valid signature


def test_untouched_artifact_under_the_wrong_key_is_refused(signed, keys):
    with pytest.raises(ArtifactError, match="not among the trusted keys"):
        read_manifest(signed, trusted_keys=[keys["theirs"][1]])


def test_unsigned_artifact_is_refused_when_keys_are_set(unsigned, keys, monkeypatch, capsys):
    with pytest.raises(ArtifactError, match=r"unsigned \(manifest.sig is missing\), and trusted keys are set"):
        LLM(unsigned, trusted_keys=[keys["ours"][1]])
    monkeypatch.setattr(envs, "TRUSTED_KEYS", (keys["ours"][1],))  # NEURON_OPT_TRUSTED_KEYS
    with pytest.raises(ArtifactError, match="unsigned"):
        LLM(unsigned)
    for argv in (["generate", str(unsigned), "--prompt", "hi"], ["serve", str(unsigned), "--port", "0"],
                 ["inspect", str(unsigned)]):
        assert main(argv) == 2 and "unsigned" in capsys.readouterr().err, argv


def test_cli_flags_check_signatures(signed, unsigned, keys, capsys):
    pub = str(keys["ours"][1])
    assert main(["generate", str(unsigned), "--prompt", "hi", "--trusted-keys", pub]) == 2
    assert "unsigned" in capsys.readouterr().err
    assert main(["serve", str(unsigned), "--port", "0", "--trusted-keys", f"{keys['theirs'][1]},{pub}"]) == 2
    assert "unsigned" in capsys.readouterr().err
    assert main(["generate", str(signed), "--prompt", "hi", "--max-new-tokens", "2", "--trusted-keys", pub]) == 0
    capsys.readouterr()
    assert main(["inspect", str(signed), "--trusted-keys", pub]) == 0
    assert f"signature: signed by key {keys['ours'][2]}, verified against trusted key {pub}" in capsys.readouterr().out
    assert main(["inspect", str(signed), "--trusted-keys", str(keys["ours"][0])]) == 2  # a private key is no pub
    assert "--trusted-keys: " in capsys.readouterr().err


def test_without_keys_loading_is_unchanged_and_inspect_says_what_it_found(signed, unsigned, keys, tmp_path, capsys):
    LLM(unsigned, trusted_keys=())
    assert main(["inspect", str(unsigned)]) == 0 and "signature: unsigned" in capsys.readouterr().out
    assert main(["inspect", str(signed)]) == 0
    assert (f"signature: signed by key {keys['ours'][2]} (not checked against trusted keys: none given)"
            in capsys.readouterr().out)
    forged = _forge(_copy(signed, tmp_path / "forged"))
    assert main(["inspect", str(forged)]) == 0
    assert "but the signature does not match the manifest" in capsys.readouterr().out


def test_refused_before_any_graph_is_loaded(unsigned, keys, tmp_path):
    """A cpu artifact whose graphs are not loadable: with trusted keys the refusal is the signature's, so the .so
    files were never opened (without keys, loading reaches them and names one)."""
    art = cpu_artifact_with_graphs(unsigned, tmp_path / "cpu", b"\x7fELF not a graph")
    with pytest.raises(ArtifactError, match="unsigned"):
        LLM(art, trusted_keys=[keys["ours"][1]])
    with pytest.raises(ArtifactError, match=r"\.so: cannot be loaded"):
        LLM(art, trusted_keys=())


def test_draft_compiled_alongside_is_signed_too(tiny_dir, keys, tmp_path):
    req = CompileRequest(model=str(tiny_dir("smollm-tok")), out=tmp_path / "spec", backend="eager", max_model_len=128,
                         prefill_buckets=(16,), decode_buckets=(128,), use_cache=False, num_speculative_tokens=2,
                         speculative_model=str(tiny_dir("smollm-tok-1layer")), sign_key=keys["ours"][0])
    compile_artifact(req, log=lambda s: None, progress=False)
    llm = LLM(tmp_path / "spec", trusted_keys=[keys["ours"][1]])
    assert llm.draft(tmp_path / "spec" / "draft", 1).trusted_keys == [keys["ours"][1]]
