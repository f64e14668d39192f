"""Artifact signatures: Ed25519 keys, a detached signature over the manifest, and its check against trusted keys.

Trust model (docs/design.md "Artifacts are native code: signed, and verified before anything runs")
- An artifact holds native code (AOTInductor .so files) that loading runs: it must be trusted like a binary. The
  manifest's sha256 of every file and its digest detect corruption; anyone who can edit the files can recompute
  them. A signature detects tampering: `manifest.sig` signs the manifest's exact bytes, and the manifest hashes
  every other file, so one signature covers the whole artifact.
- With trusted keys (`--trusted-keys`, `LLM(trusted_keys=)`, or NEURON_OPT_TRUSTED_KEYS), an artifact loads only if
  its manifest is signed by one of them; the check runs on the manifest's bytes before they are parsed, and so
  before any file of the artifact is opened. Without trusted keys nothing is required (and `inspect` says whether
  the artifact is signed, and by which key).
- The signature file carries the signer's public key, so `inspect` can name the key (its fingerprint) and check
  the signature without being given it; only a key in the trusted set makes the artifact trusted.
- What is signed is a fixed prefix + the manifest bytes, so a signature made for an artifact means nothing
  elsewhere, should the key sign other things.
- Keys are files: the private key PEM (PKCS#8, unencrypted, mode 0600, never overwritten), the public key PEM.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from neuron_opt import envs
from neuron_opt.errors import ArtifactError, ConfigError
from neuron_opt.headers import read_capped

SIGNATURE = "manifest.sig"
PRIVATE_KEY, PUBLIC_KEY = "signing.key", "signing.pub"
_DOMAIN = b"neuron-opt artifact manifest v1\0"
_MAX_KEY_BYTES = 16 << 10


@dataclass(frozen=True)
class TrustedKey:
    path: Path
    key: Ed25519PublicKey

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.key)


def fingerprint(key: Ed25519PublicKey) -> str:
    """`sha256:` + the first 32 hex digits of the sha256 of the raw 32-byte public key."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "sha256:" + hashlib.sha256(raw).hexdigest()[:32]


def generate_keypair(out_dir: Path) -> tuple[Path, Path, str]:
    """Write `out_dir/signing.key` (0600) and `out_dir/signing.pub`; (private path, public path, fingerprint).
    Refuses (ConfigError) when either file exists: a key is never overwritten."""
    out_dir = Path(out_dir)
    priv_path, pub_path = out_dir / PRIVATE_KEY, out_dir / PUBLIC_KEY
    for p in (priv_path, pub_path):
        if p.exists() or p.is_symlink():
            raise ConfigError(f"keygen: {p} exists; refusing to overwrite a key (move it away, or choose another "
                              "--out)", param="out")
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    _write_new(priv_path, pem, 0o600)  # O_EXCL: also refuses a file created since the check above
    try:
        _write_new(pub_path, pub, 0o644)
    except OSError:
        priv_path.unlink()  # ours, written a moment ago: no half pair left behind
        raise
    return priv_path, pub_path, fingerprint(key.public_key())


def _write_new(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)  # the umask may have taken bits off the public key's mode


def load_signing_key(path: Path) -> Ed25519PrivateKey:
    """The private key at `path`; ConfigError naming it when unreadable, not Ed25519, or readable by others."""
    path = Path(path)
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
        data = read_capped(path, _MAX_KEY_BYTES, ConfigError, "--sign-key")
    except OSError as e:
        raise ConfigError(f"--sign-key: cannot read {path} ({e.strerror})", param="sign_key") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"--sign-key: {path} is not an unencrypted PEM private key ({e})", param="sign_key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"--sign-key: {path} is a {type(key).__name__}, not an Ed25519 key (make one with "
                          "`neuron-opt keygen`)", param="sign_key")
    if mode & 0o077:  # as ssh refuses such a key: whoever can read it can sign artifacts we trust
        raise ConfigError(f"--sign-key: {path} is readable by others (mode {mode:04o}); a private key must be "
                          f"private: chmod 600 {path}", param="sign_key")
    return key


def load_trusted_keys(paths: Sequence[str | Path]) -> tuple[TrustedKey, ...]:
    """The public keys at `paths`; ConfigError naming the file when one is unreadable or not an Ed25519 key."""
    keys = []
    for p in map(Path, paths):
        try:
            data = read_capped(p, _MAX_KEY_BYTES, ConfigError, "--trusted-keys")
            key = serialization.load_pem_public_key(data)
        except OSError as e:
            raise ConfigError(f"--trusted-keys: cannot read {p} ({e.strerror})", param="trusted_keys") from None
        except (ValueError, TypeError) as e:
            raise ConfigError(f"--trusted-keys: {p} is not a PEM public key ({e})", param="trusted_keys") from None
        if not isinstance(key, Ed25519PublicKey):
            raise ConfigError(f"--trusted-keys: {p} is not an Ed25519 public key", param="trusted_keys")
        keys.append(TrustedKey(p, key))
    return tuple(keys)


def trusted_key_paths(paths: Sequence[str | Path] | None) -> tuple[Path, ...]:
    """The keys to trust: `paths` when given (an empty sequence trusts none), else NEURON_OPT_TRUSTED_KEYS."""
    if paths is not None:
        return tuple(Path(p) for p in paths)
    if envs.TRUSTED_KEYS == ():  # set to nothing: a check that checks nothing is refused, not taken as "off"
        raise ConfigError("NEURON_OPT_TRUSTED_KEYS is set but names no public-key file; name at least one, or unset "
                          "it to load unsigned artifacts", param="trusted_keys")
    return envs.TRUSTED_KEYS or ()


def sign_manifest(root: Path, manifest_bytes: bytes, key: Ed25519PrivateKey) -> None:
    """Write `root/manifest.sig`: the signature of `manifest_bytes` and the public key that checks it."""
    raw_pub = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    doc = {"algorithm": "ed25519", "public_key": base64.b64encode(raw_pub).decode(),
           "signature": base64.b64encode(key.sign(_DOMAIN + manifest_bytes)).decode()}
    (Path(root) / SIGNATURE).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def _read_signature(root: Path) -> tuple[Ed25519PublicKey, bytes] | None:
    """(signer's public key, signature) from `root/manifest.sig`, None when there is none."""
    path = Path(root) / SIGNATURE
    if not path.exists() and not path.is_symlink():
        return None
    try:
        doc = json.loads(read_capped(path, _MAX_KEY_BYTES, ArtifactError, "signature"))
        if doc["algorithm"] != "ed25519":
            raise ValueError(f"algorithm {doc['algorithm']!r}")
        pub = Ed25519PublicKey.from_public_bytes(base64.b64decode(doc["public_key"], validate=True))
        return pub, base64.b64decode(doc["signature"], validate=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ArtifactError(f"{path}: not a signature this install reads ({e})") from None


def check_signature(root: Path, manifest_bytes: bytes, trusted: Sequence[TrustedKey]) -> str:
    """Check `root`'s signature of `manifest_bytes`. With `trusted` keys, an unsigned artifact, one signed by
    another key, or a signature that does not match the bytes is refused (ArtifactError saying which). Returns a
    line saying what was found, for `inspect`."""
    sig = _read_signature(root)
    if sig is None:
        if trusted:
            raise ArtifactError(f"{root}: unsigned ({SIGNATURE} is missing), and trusted keys are set: only an "
                                "artifact signed by one of them loads (compile --sign-key)")
        return "unsigned"
    signer, signature = sig
    if not trusted:
        if _verifies(signer, signature, manifest_bytes):
            return f"signed by key {fingerprint(signer)} (not checked against trusted keys: none given)"
        return (f"signed by key {fingerprint(signer)}, but the signature does not match the manifest (edited after "
                "signing)")
    match = [t for t in trusted if t.fingerprint == fingerprint(signer)]
    if not match:
        raise ArtifactError(f"{root}: signed by key {fingerprint(signer)}, which is not among the trusted keys ("
                            + ", ".join(f"{t.path}: {t.fingerprint}" for t in trusted) + ")")
    if not _verifies(match[0].key, signature, manifest_bytes):  # the trusted key itself, not the file's copy
        raise ArtifactError(f"{root}: the signature does not match its manifest.json (the manifest was edited after "
                            "signing, so none of the artifact's files can be trusted)")
    return f"signed by key {match[0].fingerprint}, verified against trusted key {match[0].path}"


def _verifies(key: Ed25519PublicKey, signature: bytes, manifest_bytes: bytes) -> bool:
    try:
        key.verify(signature, _DOMAIN + manifest_bytes)
        return True
    except InvalidSignature:
        return False
