"""Artifacts in object storage: `s3://bucket/prefix` on S3 or any S3-compatible store (boto3, the `s3` extra).

Layout: the artifact's files under the prefix with their paths unchanged (`s3://b/p/weights/rank0.safetensors`),
`manifest.sig` when signed, and `manifest.json`.

Contracts
- Push uploads a verified local artifact (every hash checked first) file by file, the manifest last: a reader
  finds an artifact at a prefix only once `manifest.json` is there, so an interrupted push is never visible.
  A prefix that already holds an artifact is replaced only with `force`: its manifest is deleted first (the old
  artifact disappears before any file changes), and after the new manifest lands only the keys the old manifest
  listed and the new one does not are deleted; no other key is touched.
- Pull reads the manifest (size-capped), checks the signature when keys are trusted, and checks the format and
  versions before downloading anything else; every file is hashed once it has downloaded (the bytes on disk, after
  any retry) and compared with the manifest. The artifact lands in a local cache
  (`$NEURON_OPT_CACHE_DIR/artifacts/<sha256 of the manifest's bytes>`), atomically (a temporary sibling renamed
  into place), and is then loaded like any local artifact, with every check of `neuron_opt.artifact`. The key is
  the hash of the manifest's bytes, which hold every file's hash: a cached copy answers the same manifest only. A
  later pull of the same manifest verifies the cached copy and downloads nothing. Files hashed by the pull (once
  downloaded, or the cached copy's) are not hashed again by the loader in the same process while they stay
  unchanged (`neuron_opt.artifact.record_hashed`, read_verified).
- Faults: every S3 call is retried with backoff on throttling (503 SlowDown), 5xx and dropped connections
  (botocore's "standard" retry mode, MAX_ATTEMPTS tries); a body cut short or reset while it downloads is fetched
  again and written over its own offsets (s3transfer, MAX_ATTEMPTS tries; the manifest and its signature, read
  whole, are fetched again the same way), and whatever arrives is hashed against
  the manifest before the file is used. A pull that still fails raises ArtifactError and leaves nothing in the
  cache: the download's temporary directory is removed, and only a complete, verified copy is ever renamed into
  place. A cached copy is used only when its `manifest.json` equals the store's byte for byte (else it is
  downloaded again).
- Credentials come from boto3's usual chain (environment, profile, instance role); the endpoint from
  `endpoint_url` (`--s3-endpoint-url`), else boto3's own `AWS_ENDPOINT_URL`.
- On the neuron backend the NEFFs live inside the artifact (`graphs/*/neuron_cache/`), so they travel with it and
  an instance that pulls an artifact compiles nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from tqdm import tqdm

from neuron_opt import envs
from neuron_opt.artifact import (
    FORMAT_VERSION,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    read_verified,
    record_hashed,
    sha256_file,
    versions,
)
from neuron_opt.errors import ArtifactError, ConfigError
from neuron_opt.signing import SIGNATURE, check_signature, load_trusted_keys, trusted_key_paths

SCHEME = "s3://"
# S3's bucket naming rules: 3-63 characters of lowercase letters, digits, dots and hyphens, a letter or digit at
# each end
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_SHA256 = re.compile(r"[0-9a-f]{64}")
MULTIPART_THRESHOLD = 64 << 20  # files past this upload and download in parts, several at once
MAX_ATTEMPTS = 8  # tries of each S3 call (botocore "standard" retries) and of each download's body (s3transfer)


def is_remote(path: str | os.PathLike[str]) -> bool:
    return str(path).startswith(SCHEME)


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # without leading or trailing "/"; "" for the bucket's root

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{SCHEME}{self.bucket}"


def parse_s3(uri: str, param: str = "artifact") -> S3Location:
    if not is_remote(uri):
        raise ConfigError(f"{param}: {uri!r} is not an s3:// URI", param=param)
    bucket, _, prefix = uri[len(SCHEME):].partition("/")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise ConfigError(f"{param}: {uri!r}: {bucket!r} is not a valid bucket name (3-63 lowercase letters, "
                          "digits, dots and hyphens)", param=param)
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise ConfigError(f"{param}: {uri!r}: the prefix has an empty, '.' or '..' segment", param=param)
    return S3Location(bucket, prefix)


def client(endpoint_url: str | None = None) -> Any:
    """A boto3 S3 client: the usual credential chain; `endpoint_url`, else AWS_ENDPOINT_URL, else AWS's."""
    try:  # boto3 and botocore: the `s3` extra, imported where a client is made or its errors are read
        import boto3
        from botocore.config import Config
    except ImportError:
        raise ConfigError("s3:// artifacts need boto3: pip install 'neuron-opt[s3]'", param="artifact") from None
    return boto3.client("s3", endpoint_url=endpoint_url or None,
                        config=Config(retries={"mode": "standard", "max_attempts": MAX_ATTEMPTS}))


def _transfer_config() -> Any:
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_THRESHOLD,
                          num_download_attempts=MAX_ATTEMPTS)


def _missing(e: Exception) -> bool:
    code = str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))
    return code in ("404", "NoSuchKey", "NotFound")


def _get_small(s3: Any, loc: S3Location, rel: str, cap: int) -> bytes | None:
    """The object's bytes, None when it does not exist; ArtifactError past `cap` bytes (checked before reading). A
    body cut short (the connection dropped mid-body, or fewer bytes than its ContentLength: a read with a size
    does not check that) is fetched again, up to MAX_ATTEMPTS tries with backoff."""
    from botocore.exceptions import BotoCoreError, ClientError

    for attempt in range(1, MAX_ATTEMPTS + 1):
        try:
            obj = s3.get_object(Bucket=loc.bucket, Key=loc.key(rel))
        except ClientError as e:
            if _missing(e):
                return None
            raise ArtifactError(f"{loc}/{rel}: {e}") from None
        size = obj["ContentLength"]
        if size > cap:
            obj["Body"].close()
            raise ArtifactError(f"{loc}/{rel}: {size} bytes, more than the {cap} a manifest may have")
        try:
            data = obj["Body"].read(cap + 1)
        except BotoCoreError as e:  # botocore's wrapping of the connection's errors mid-body
            why = f"{type(e).__name__}: {e}"
        else:
            if len(data) == size:
                return data
            why = f"{len(data)} of {size} bytes arrived"
        if attempt < MAX_ATTEMPTS:
            time.sleep(min(0.1 * 2 ** attempt, 5.0))
    raise ArtifactError(f"{loc}/{rel}: the body was cut short on each of {MAX_ATTEMPTS} tries (last: {why})")


def _manifest_files(raw: Any, where: str) -> dict[str, str]:
    """The manifest's file list, each path relative inside the artifact and each hash a sha256 (checked before
    any path is used to name a key or a local file)."""
    files = raw.get("files") if isinstance(raw, dict) else None
    if not isinstance(files, dict):
        raise ArtifactError(f"{where}: invalid manifest (no files object)")
    for rel, digest in files.items():
        p = PurePosixPath(rel) if isinstance(rel, str) and rel else None
        if p is None or p.is_absolute() or ".." in p.parts or "\\" in rel or str(p) != rel \
                or str(p) in (MANIFEST, SIGNATURE):
            raise ArtifactError(f"{where}: files names {rel!r}, which is not a relative path inside the artifact")
        if not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
            raise ArtifactError(f"{where}: files[{rel!r}] is not a sha256 ({digest!r})")
    return files


def check_destination(uri: str, *, endpoint_url: str | None = None, force: bool = False) -> S3Location:
    """What `push` would refuse, checked before a long compile: a bad URI, a prefix holding an artifact without
    `force`, a store that cannot be reached."""
    loc = parse_s3(uri, "out")
    if _get_small(client(endpoint_url), loc, MANIFEST, MAX_MANIFEST_BYTES) is not None and not force:
        raise ConfigError(f"--out {loc} already holds an artifact ({MANIFEST}); pass --force to replace it",
                          param="out")
    return loc


def staging_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A path (not yet created) in the artifact cache where an artifact for upload is compiled."""
    root = cache_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    return root / f".staging-{os.getpid()}-{os.urandom(4).hex()}"


def push(local: str | os.PathLike[str], uri: str, *, endpoint_url: str | None = None, force: bool = False,
         progress: bool = True, on_file: Callable[[str], None] | None = None) -> S3Location:
    """Upload the artifact at `local` to `uri` (module docstring). `on_file(rel)` is called after each file."""
    local = Path(local)
    verified = read_verified(local, verify_hashes=True, trusted_keys=())  # never upload a corrupt artifact
    loc = parse_s3(uri, "out")
    s3 = client(endpoint_url)
    old = _get_small(s3, loc, MANIFEST, MAX_MANIFEST_BYTES)
    old_files: dict[str, str] = {}
    if old is not None:
        if not force:
            raise ConfigError(f"{loc} already holds an artifact ({MANIFEST}); pass --force to replace it",
                              param="out")
        try:
            old_files = _manifest_files(json.loads(old), f"{loc}/{MANIFEST}")
        except (ValueError, ArtifactError):
            old_files = {}  # an unreadable old manifest: replace it, delete nothing else
        # the old artifact disappears before any of its files changes
        s3.delete_object(Bucket=loc.bucket, Key=loc.key(MANIFEST))
        s3.delete_object(Bucket=loc.bucket, Key=loc.key(SIGNATURE))
    files = verified.manifest.files
    total = sum((local / rel).stat().st_size for rel in files)
    config = _transfer_config()
    with tqdm(total=total, desc=f"upload {loc}", unit="B", unit_scale=True, disable=not progress) as bar:
        for rel in sorted(files):
            s3.upload_file(str(local / rel), loc.bucket, loc.key(rel), Config=config,
                           ExtraArgs={"ChecksumAlgorithm": "SHA256"}, Callback=bar.update)
            if on_file is not None:
                on_file(rel)
    checked = {"ChecksumAlgorithm": "SHA256"}  # the store checks each object's (each part's) bytes as received
    if (local / SIGNATURE).is_file():
        s3.upload_file(str(local / SIGNATURE), loc.bucket, loc.key(SIGNATURE), ExtraArgs=checked)
    s3.upload_file(str(local / MANIFEST), loc.bucket, loc.key(MANIFEST), ExtraArgs=checked)
    for rel in sorted(set(old_files) - set(files)):
        s3.delete_object(Bucket=loc.bucket, Key=loc.key(rel))
    return loc


def _precheck(raw: Any, where: str) -> None:
    """What can be refused from the manifest alone, before any download: format and versions."""
    if not isinstance(raw, dict) or raw.get("format_version") != FORMAT_VERSION:
        version = raw.get("format_version") if isinstance(raw, dict) else None
        raise ArtifactError(f"{where}: format version {version} differs from this install's {FORMAT_VERSION}; "
                            "recompile the artifact")
    ours = versions()
    theirs = raw.get("versions") if isinstance(raw.get("versions"), dict) else {}
    for name in ("neuron_opt", "torch"):
        if theirs.get(name) != ours[name]:
            raise ArtifactError(f"{where}: compiled with {name} {theirs.get(name)}, this install has {ours[name]}; "
                                "recompile the artifact")


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    return Path(cache_dir) if cache_dir is not None else envs.CACHE_DIR / "artifacts"


def pull(uri: str, *, endpoint_url: str | None = None, trusted_keys: Sequence[str | Path] | None = None,
         cache_dir: str | os.PathLike[str] | None = None, verify_hashes: bool = True, progress: bool = True) -> Path:
    """The local copy of the artifact at `uri`, downloaded once into the artifact cache (module docstring)."""
    loc = parse_s3(uri)
    s3 = client(endpoint_url)
    data = _get_small(s3, loc, MANIFEST, MAX_MANIFEST_BYTES)
    if data is None:
        raise ArtifactError(f"{loc}: no artifact there (no {loc}/{MANIFEST}); push one with `neuron-opt push` "
                            "or `neuron-opt compile --out s3://...`")
    root = cache_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    dest = root / hashlib.sha256(data).hexdigest()
    if dest.is_dir():
        try:
            _check_cached(dest, data)
            read_verified(dest, verify_hashes=verify_hashes, trusted_keys=trusted_keys)
            return dest
        except ArtifactError as e:  # a damaged or swapped cached copy is replaced by a fresh download
            print(f"warning: cached copy {dest} of {loc} is damaged ({e}); downloading it again")
    sig = _get_small(s3, loc, SIGNATURE, 1 << 16)
    tmp = Path(tempfile.mkdtemp(prefix=".pull-", dir=root))
    try:
        (tmp / MANIFEST).write_bytes(data)
        if sig is not None:
            (tmp / SIGNATURE).write_bytes(sig)
        # the signature over the bytes parsed below, before anything they say is used
        check_signature(tmp, data, load_trusted_keys(trusted_key_paths(trusted_keys)))
        try:
            raw = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise ArtifactError(f"{loc}/{MANIFEST}: corrupt manifest ({e})") from None
        _precheck(raw, str(loc))
        files = _manifest_files(raw, f"{loc}/{MANIFEST}")
        _download(s3, loc, files, tmp, tqdm, progress)
        read_verified(tmp, verify_hashes=False, trusted_keys=trusted_keys)  # every other check; hashed above
        if dest.is_dir():  # a damaged copy found above
            shutil.rmtree(dest)
        try:
            os.replace(tmp, dest)
        except OSError:
            if not dest.is_dir():
                raise
            # a concurrent pull of the same manifest landed first: its copy is the same bytes
        else:
            record_hashed(dest, data, list(files))  # hashed while downloading: the loader need not hash again
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _check_cached(dest: Path, data: bytes) -> None:
    """ArtifactError unless the cached copy's manifest is, byte for byte, the store's (`data`)."""
    try:
        cached = (dest / MANIFEST).read_bytes()
    except OSError as e:
        raise ArtifactError(f"{dest}/{MANIFEST}: unreadable ({e})") from None
    if cached != data:
        raise ArtifactError(f"{dest}/{MANIFEST} differs from the store's manifest")


def _download(s3: Any, loc: S3Location, files: dict[str, str], tmp: Path, tqdm: Any, progress: bool) -> None:
    from botocore.exceptions import ClientError

    config = _transfer_config()
    with tqdm(desc=f"download {loc}", unit="B", unit_scale=True, disable=not progress) as bar:
        for rel, digest in sorted(files.items()):
            path = tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:  # seekable: a retried part is written again at its own offset
                try:
                    s3.download_fileobj(loc.bucket, loc.key(rel), f, Config=config, Callback=bar.update)
                except ClientError as e:
                    if _missing(e):
                        raise ArtifactError(f"{loc}/{rel}: listed in the manifest but missing from the store "
                                            "(an interrupted or partial push?)") from None
                    raise ArtifactError(f"{loc}/{rel}: {e}") from None
            if sha256_file(path) != digest:  # the bytes that landed, whatever retries it took
                raise ArtifactError(f"{loc}/{rel}: sha256 does not match the manifest (object modified or corrupt)")


def resolve(path: str | os.PathLike[str], *, endpoint_url: str | None = None,
            trusted_keys: Sequence[str | Path] | None = None, verify_hashes: bool = True) -> Path:
    """A local artifact directory for `path`: itself, or for an s3:// URI the pulled local copy."""
    if is_remote(path):
        return pull(str(path), endpoint_url=endpoint_url, trusted_keys=trusted_keys, verify_hashes=verify_hashes)
    return Path(path)


def adopt(local: Path, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Move a just-pushed local artifact into the artifact cache under its manifest's hash (so serving the URI on
    this machine downloads nothing); returns where it now is."""
    root = cache_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    dest = root / hashlib.sha256((local / MANIFEST).read_bytes()).hexdigest()
    if dest.is_dir():
        shutil.rmtree(local)
        return dest
    os.replace(local, dest)
    return dest


__all__ = ["S3Location", "adopt", "cache_root", "check_destination", "client", "is_remote", "parse_s3", "pull", "push",
           "resolve", "staging_dir"]
