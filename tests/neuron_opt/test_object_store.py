"""Artifacts in object storage, against a real S3 API: moto's server on loopback, started here.

Push (verified first, the manifest last, --force semantics), pull (signature and versions before any download,
every file hashed as it arrives, an atomic landing in the local cache, a warm cache that downloads nothing),
LLM("s3://...") and the CLI (compile --out s3://, generate s3://, pull --out) against the local artifact.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import time

import pytest
from helpers import compile_tiny_eager

from neuron_opt import envs, object_store
from neuron_opt.api import LLM
from neuron_opt.artifact import MANIFEST, manifest_digest
from neuron_opt.cli import main
from neuron_opt.errors import ArtifactError, ConfigError
from neuron_opt.runtime.sampling import SamplingParams
from neuron_opt.signing import generate_keypair

BUCKET = "artifacts"
GREEDY = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def endpoint():
    """A moto S3 server on a free loopback port, with one bucket; credentials of its own in the environment."""
    from moto.server import ThreadedMotoServer

    mp = pytest.MonkeyPatch()
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        mp.setenv(name, value)
    mp.delenv("AWS_ENDPOINT_URL", raising=False)
    mp.delenv("AWS_PROFILE", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    object_store.client(url).create_bucket(Bucket=BUCKET)
    yield url
    server.stop()
    mp.undo()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh local artifact cache for each test."""
    monkeypatch.setattr(envs, "CACHE_DIR", tmp_path / "cache")
    return tmp_path / "cache" / "artifacts"




@pytest.fixture(scope="module")
def art(tiny_dir, tmp_path_factory):
    return compile_tiny_eager(tiny_dir, tmp_path_factory.mktemp("art") / "art")


def _keys(s3, prefix):
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", []))


def _local_files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_push_pull_round_trip_and_llm(art, endpoint, cache):
    uri = f"s3://{BUCKET}/models/tiny"
    loc = object_store.push(art, uri, endpoint_url=endpoint, progress=False)
    assert str(loc) == uri
    local = object_store.pull(uri, endpoint_url=endpoint, progress=False)
    assert local.parent == cache and local.name == hashlib.sha256((art / MANIFEST).read_bytes()).hexdigest()
    assert _local_files(local) == _local_files(art)
    assert [p.name for p in cache.iterdir()] == [local.name]  # no temporary directory left behind
    prompt = "The capital of France is"
    remote = LLM(uri, s3_endpoint_url=endpoint).generate(prompt, GREEDY)
    assert remote.token_ids == LLM(str(art)).generate(prompt, GREEDY).token_ids

    # warm: the cached copy is verified and used; nothing is downloaded (the store no longer has the weights)
    s3 = object_store.client(endpoint)
    s3.delete_object(Bucket=BUCKET, Key="models/tiny/weights/rank0.safetensors")
    assert object_store.pull(uri, endpoint_url=endpoint, progress=False) == local


def test_tampered_object_is_refused_and_nothing_lands(art, endpoint, cache):
    uri = f"s3://{BUCKET}/tampered"
    object_store.push(art, uri, endpoint_url=endpoint, progress=False)
    s3 = object_store.client(endpoint)
    w = (art / "weights" / "rank0.safetensors").read_bytes()
    s3.put_object(Bucket=BUCKET, Key="tampered/weights/rank0.safetensors", Body=w[:-1] + bytes([w[-1] ^ 0xFF]))
    with pytest.raises(ArtifactError, match=r"rank0\.safetensors: sha256 does not match"):
        object_store.pull(uri, endpoint_url=endpoint, progress=False)
    assert list(cache.iterdir()) == []


def test_interrupted_push_is_never_visible(art, endpoint, cache):
    uri = f"s3://{BUCKET}/interrupted"
    uploaded = []

    def interrupt(rel):
        uploaded.append(rel)
        raise KeyboardInterrupt  # the operator's Ctrl-C after the first file

    with pytest.raises(KeyboardInterrupt):
        object_store.push(art, uri, endpoint_url=endpoint, progress=False, on_file=interrupt)
    s3 = object_store.client(endpoint)
    assert _keys(s3, "interrupted/") == [f"interrupted/{uploaded[0]}"]  # the file, no manifest
    with pytest.raises(ArtifactError, match="no artifact there"):
        object_store.pull(uri, endpoint_url=endpoint, progress=False)


def test_replace_needs_force_and_deletes_only_what_the_old_manifest_listed(art, endpoint, cache):
    uri, prefix = f"s3://{BUCKET}/replace", "replace/"
    object_store.push(art, uri, endpoint_url=endpoint, progress=False)
    s3 = object_store.client(endpoint)
    # the old artifact at the prefix also listed a file the new one does not have; the bucket's owner keeps notes
    old = json.loads((art / MANIFEST).read_bytes())
    old["files"]["weights/stale.bin"] = hashlib.sha256(b"stale").hexdigest()
    s3.put_object(Bucket=BUCKET, Key=prefix + "weights/stale.bin", Body=b"stale")
    s3.put_object(Bucket=BUCKET, Key=prefix + MANIFEST, Body=json.dumps(old).encode())
    s3.put_object(Bucket=BUCKET, Key=prefix + "notes.txt", Body=b"ours")
    with pytest.raises(ConfigError, match="already holds an artifact.*--force"):
        object_store.push(art, uri, endpoint_url=endpoint, progress=False)
    object_store.push(art, uri, endpoint_url=endpoint, force=True, progress=False)
    keys = _keys(s3, prefix)
    assert prefix + "weights/stale.bin" not in keys and prefix + "notes.txt" in keys
    assert _local_files(object_store.pull(uri, endpoint_url=endpoint, progress=False)) == _local_files(art)


@pytest.fixture
def hashed(monkeypatch):
    """The files neuron_opt.artifact hashes with sha256_file (a fresh per-process memo; files look 10 s old
    unless a test says otherwise)."""
    from neuron_opt import artifact

    seen: list[str] = []
    real_hash, real_now = artifact.sha256_file, artifact._now_ns
    monkeypatch.setattr(artifact, "_HASHED", {})
    monkeypatch.setattr(artifact, "sha256_file", lambda path, *a: seen.append(path.name) or real_hash(path, *a))
    monkeypatch.setattr(artifact, "_now_ns", lambda: real_now() + 10 * 10**9)
    return seen


def test_a_pulled_copy_is_hashed_once_per_process_until_a_file_changes(art, endpoint, cache, hashed):
    from neuron_opt import artifact

    files = sorted(json.loads((art / MANIFEST).read_bytes())["files"])
    uri = f"s3://{BUCKET}/once"
    object_store.push(art, uri, endpoint_url=endpoint, progress=False)  # verifies the local artifact first
    artifact.read_verified(art)
    assert sorted(hashed) == sorted(p.rsplit("/", 1)[-1] for p in files)  # once, not twice
    hashed.clear()
    local = object_store.pull(uri, endpoint_url=endpoint, progress=False)  # cold: hashed as it downloads
    assert artifact.read_verified(local).files_verified and hashed == []
    artifact._HASHED.clear()  # a new process with a warm cache: pull checks the cached copy, the loader does not
    assert object_store.pull(uri, endpoint_url=endpoint, progress=False) == local
    assert len(hashed) == len(files)
    hashed.clear()
    artifact.read_verified(local)
    assert hashed == []
    # one byte changed in place, the size and the mtime as before: the ctime differs, so it is hashed again
    w = local / "weights" / "rank0.safetensors"
    st = w.stat()
    time.sleep(0.05)  # past the filesystem's timestamp granularity
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF
    w.write_bytes(bytes(data))
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ArtifactError, match=r"rank0\.safetensors: sha256 does not match"):
        artifact.read_verified(local)
    assert hashed == ["rank0.safetensors"]


def test_a_file_changed_within_the_racy_window_is_hashed_again(art, hashed, monkeypatch):
    from neuron_opt import artifact

    artifact.read_verified(art)
    n = len(hashed)
    monkeypatch.setattr(artifact, "RACY_NS", 10**15)  # every file changed "just now": no stamp is trusted
    artifact._HASHED.clear()
    artifact.read_verified(art)
    artifact.read_verified(art)
    assert len(hashed) == 3 * n


def test_signature_checked_before_any_download(tiny_dir, endpoint, cache, tmp_path):
    ours, theirs = generate_keypair(tmp_path / "ours"), generate_keypair(tmp_path / "theirs")
    signed = compile_tiny_eager(tiny_dir, tmp_path / "signed", ours[0])
    uri = f"s3://{BUCKET}/signed"
    object_store.push(signed, uri, endpoint_url=endpoint, progress=False)
    s3 = object_store.client(endpoint)
    # were the weights fetched, the missing object would be the error; the signature is refused first
    s3.delete_object(Bucket=BUCKET, Key="signed/weights/rank0.safetensors")
    with pytest.raises(ArtifactError, match="sign"):
        object_store.pull(uri, endpoint_url=endpoint, trusted_keys=[theirs[1]], progress=False)
    assert list(cache.iterdir()) == []
    with pytest.raises(ArtifactError, match="missing from the store"):
        object_store.pull(uri, endpoint_url=endpoint, trusted_keys=[ours[1]], progress=False)
    object_store.push(signed, uri, endpoint_url=endpoint, force=True, progress=False)
    assert (object_store.pull(uri, endpoint_url=endpoint, trusted_keys=[ours[1]], progress=False)
            / "manifest.sig").is_file()


def test_manifest_paths_and_versions_refused_before_download(art, endpoint, cache, tmp_path):
    s3 = object_store.client(endpoint)
    raw = json.loads((art / MANIFEST).read_bytes())
    escape = dict(raw, files={**raw["files"], "../../evil": hashlib.sha256(b"x").hexdigest()})
    escape["digest"] = manifest_digest(escape)
    s3.put_object(Bucket=BUCKET, Key="escape/" + MANIFEST, Body=json.dumps(escape).encode())
    with pytest.raises(ArtifactError, match=r"'\.\./\.\./evil', which is not a relative path inside"):
        object_store.pull(f"s3://{BUCKET}/escape", endpoint_url=endpoint, progress=False)
    old = dict(raw, versions={**raw["versions"], "torch": "1.0"})
    s3.put_object(Bucket=BUCKET, Key="old/" + MANIFEST, Body=json.dumps(old).encode())
    with pytest.raises(ArtifactError, match="compiled with torch 1.0"):
        object_store.pull(f"s3://{BUCKET}/old", endpoint_url=endpoint, progress=False)
    assert list(cache.iterdir()) == []
    assert not (tmp_path / "evil").exists()


@pytest.mark.parametrize("uri", ["s3://Bad_Bucket/x", "s3://ab/x", "s3://bucket/a/../b", "/not/s3"])
def test_bad_uris_name_the_field(uri):
    with pytest.raises(ConfigError, match="out: "):
        object_store.parse_s3(uri, "out")


def test_cli_compile_to_s3_then_generate_and_pull(tiny_dir, art, endpoint, cache, tmp_path, capsys):
    uri = f"s3://{BUCKET}/cli/tiny"
    compile_argv = ["compile", "--model", str(tiny_dir("smollm-tok")), "--backend", "eager", "--max-model-len",
                    "128", "--prefill-buckets", "16", "--decode-buckets", "128", "--no-cache", "--out", uri,
                    "--s3-endpoint-url", endpoint]
    assert main(compile_argv) == 0
    out = capsys.readouterr().out
    assert f"uploaded to {uri}" in out
    # the compiled copy went into the local cache: generate finds it there without downloading
    local = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert len(local) == 1
    assert main(compile_argv) == 2  # the prefix holds an artifact now: refused before compiling
    assert "already holds an artifact" in capsys.readouterr().err
    assert main(["generate", uri, "--prompt", "hi", "--max-new-tokens", "4", "--json",
                 "--s3-endpoint-url", endpoint]) == 0
    ids = json.loads(capsys.readouterr().out)["token_ids"]
    assert ids == LLM(str(art)).generate("hi", SamplingParams(max_tokens=4)).token_ids
    assert main(["pull", uri, "--out", str(tmp_path / "copy"), "--s3-endpoint-url", endpoint]) == 0
    assert _local_files(tmp_path / "copy") == _local_files(local[0])
    assert main(["inspect", uri, "--s3-endpoint-url", endpoint]) == 0
    assert "verified" in capsys.readouterr().out


# ---- storage faults ----------------------------------------------------------------------------------------
# Injected with botocore's own event hook `before-send.s3.<Operation>` on the real clients (registered on boto3's
# default session, whose clients copy its handlers): a handler that returns a response stands in for the store's
# answer, one that raises stands in for the network; botocore's retry logic and s3transfer's download loop run
# unchanged on what it returns. moto's server cannot answer 503 SlowDown or cut a body short by itself.


@contextlib.contextmanager
def faults(operation: str, respond, received=None):
    """Each call of `operation` (an S3 API name) goes through `respond(request, n)` (n: 1 for the first call):
    it returns an AWSResponse (the store's answer), raises (the network failed), or returns None (sent for real);
    `received(parsed, n)` sees each parsed response. Yields the list of calls' URLs."""
    import boto3

    boto3.setup_default_session()
    calls: list[str] = []

    def before(request, **_):
        calls.append(request.url)
        return respond(request, len(calls))

    boto3.DEFAULT_SESSION.events.register(f"before-send.s3.{operation}", before)
    if received is not None:
        boto3.DEFAULT_SESSION.events.register(f"after-call.s3.{operation}",
                                              lambda parsed, **_: received(parsed, len(calls)))
    try:
        yield calls
    finally:
        boto3.DEFAULT_SESSION = None


class _Body:
    """An error response's body, as botocore reads it (`stream`)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def stream(self, *_a, **_k):
        yield self.data


class _Cut:
    """A response body's socket stream that ends after `n` bytes (the connection closed mid-object)."""

    def __init__(self, raw, n: int) -> None:
        self.raw, self.left = raw, n

    def read(self, amt=None, **_):
        data = self.raw.read(self.left if amt is None else min(amt, self.left))
        self.left -= len(data)
        return data


SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your '
             b"request rate.</Message></Error>")


def test_throttling_resets_and_short_reads_are_retried(art, endpoint, cache):
    from botocore.awsrequest import AWSResponse
    from botocore.exceptions import ConnectionClosedError

    uri = f"s3://{BUCKET}/flaky"
    object_store.push(art, uri, endpoint_url=endpoint, progress=False)
    weights: list[int] = []  # the calls (n) that fetched the weights file

    def flaky(request, n):
        if n <= 2:  # the manifest's GET: throttled twice (S3's 503 SlowDown)
            return AWSResponse(request.url, 503, {"Content-Type": "application/xml"}, _Body(SLOW_DOWN))
        if "rank0.safetensors" in request.url:
            weights.append(n)
            if len(weights) == 1:  # the connection drops before an answer
                raise ConnectionClosedError(endpoint_url=request.url)
        return None

    def short(parsed, n):
        if len(weights) == 2 and weights[-1] == n:  # the second try's body ends half-way (a short read)
            body = parsed["Body"]
            body._raw_stream = _Cut(body._raw_stream, parsed["ContentLength"] // 2)

    with faults("GetObject", flaky, short) as calls:
        local = object_store.pull(uri, endpoint_url=endpoint, progress=False)
    assert calls[:3] == [calls[0]] * 3 and len(weights) == 3, calls
    assert _local_files(local) == _local_files(art)


def test_a_manifest_whose_body_is_cut_is_read_again(art, endpoint, cache):
    """The manifest (read whole by one GET, not by s3transfer) cut short twice, as a connection closed mid-body:
    read again each time, and the pull completes."""
    uri = f"s3://{BUCKET}/cut-manifest"
    object_store.push(art, uri, endpoint_url=endpoint, progress=False)

    def short(parsed, n):
        if n <= 2 and parsed.get("ContentLength", 0) > 2:  # the manifest's first two GETs
            body = parsed["Body"]
            body._raw_stream = _Cut(body._raw_stream, parsed["ContentLength"] // 2)

    with faults("GetObject", lambda request, n: None, short) as calls:
        local = object_store.pull(uri, endpoint_url=endpoint, progress=False)
    assert calls[:3] == [calls[0]] * 3 and calls[0].endswith(MANIFEST), calls
    assert _local_files(local) == _local_files(art)


def test_a_truncated_object_fails_clearly_and_nothing_lands(art, endpoint, cache):
    uri = f"s3://{BUCKET}/truncated"
    object_store.push(art, uri, endpoint_url=endpoint, progress=False)
    s3 = object_store.client(endpoint)
    w = (art / "weights" / "rank0.safetensors").read_bytes()
    s3.put_object(Bucket=BUCKET, Key="truncated/weights/rank0.safetensors", Body=w[: len(w) // 3])
    with pytest.raises(ArtifactError, match=r"rank0\.safetensors: sha256 does not match"):
        object_store.pull(uri, endpoint_url=endpoint, progress=False)
    assert list(cache.iterdir()) == []  # neither a partial copy nor a temporary directory


def test_a_cached_copy_is_used_only_when_its_manifest_equals_the_stores(art, endpoint, cache, tmp_path):
    uri = f"s3://{BUCKET}/stale"
    object_store.push(art, uri, endpoint_url=endpoint, progress=False)
    old = object_store.pull(uri, endpoint_url=endpoint, progress=False)
    # the prefix gets a new artifact (here: the same files, another manifest): the next pull is a new copy
    other = tmp_path / "other"
    shutil.copytree(art, other)
    raw = json.loads((other / MANIFEST).read_bytes())
    raw["source"]["model"] = "elsewhere"
    raw["digest"] = manifest_digest(raw)
    (other / MANIFEST).write_bytes(json.dumps(raw).encode())
    object_store.push(other, uri, endpoint_url=endpoint, force=True, progress=False)
    new = object_store.pull(uri, endpoint_url=endpoint, progress=False)
    assert new != old and (new / MANIFEST).read_bytes() == (other / MANIFEST).read_bytes()
    # a cached copy whose manifest was swapped for another (valid) one is downloaded again
    (new / MANIFEST).write_bytes((old / MANIFEST).read_bytes())
    assert object_store.pull(uri, endpoint_url=endpoint, progress=False) == new
    assert (new / MANIFEST).read_bytes() == (other / MANIFEST).read_bytes()


def test_an_empty_trusted_key_set_is_an_error(art, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", str(art), "--trusted-keys", ""])
    assert exit_.value.code == 2
    assert "an empty set of keys would accept any artifact" in capsys.readouterr().err
    monkeypatch.setattr(envs, "TRUSTED_KEYS", ())  # NEURON_OPT_TRUSTED_KEYS="" or ","
    with pytest.raises(ConfigError, match="NEURON_OPT_TRUSTED_KEYS is set but names no public-key file"):
        LLM(str(art))
