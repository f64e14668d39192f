"""Content-addressed compile cache: one entry per bucket graph.

The key of a bucket's graph hashes every input that can change the compiled code: the weights' fingerprint, the
model/parallel/cache config, the bucket, the backend and its options (compiler flags), the dtype and the versions.
A recompile with one bucket added compiles only that bucket; on a miss, `explain_miss` names the key fields that
differ from the closest earlier entry of the same bucket, so users see *why* a compile was not cached.

Entries are written atomically (temp directory + rename); a half-written entry is never visible.

An entry holds native code that `compile` copies into artifacts, so the cache is guarded like one:
- each entry records its files' sha256 when it is written; a hit is copied and the copy re-hashed before it is
  used, and any mismatch (a corrupted or edited entry) is a miss: the entry is removed, a warning names it, and
  the bucket is recompiled and stored again. A hash detects corruption; it cannot tell who wrote the entry, so:
- the cache directory is created 0700 (an existing one of ours is set to 0700), and a directory owned by another
  user is refused: whoever can write the cache can put code into our artifacts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_opt.artifact import sha256_file
from neuron_opt.errors import ConfigError

log = logging.getLogger(__name__)


def _canon(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


@dataclass(frozen=True)
class CacheKey:
    fields: dict[str, Any]

    @property
    def digest(self) -> str:
        return hashlib.sha256(_canon(self.fields).encode()).hexdigest()[:32]


class CompileCache:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.rejected: dict[str, str] = {}  # entry digest -> why `fetch` refused it (explain_miss reports it)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = self.root.stat()
        if st.st_uid != os.getuid():
            raise ConfigError(f"compile cache: {self.root} is owned by uid {st.st_uid}, not by this user (uid "
                              f"{os.getuid()}); its graphs would run in our artifacts. Point NEURON_OPT_CACHE_DIR at "
                              "a directory of your own, or compile with --no-cache")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(self.root, 0o700)

    def entry_dir(self, key: CacheKey) -> Path:
        return self.root / key.digest

    def lookup(self, key: CacheKey) -> list[Path] | None:
        """Files of a cached graph (relative to the entry dir), or None on a miss (no entry, a file missing, or an
        entry written without hashes)."""
        d = self.entry_dir(key)
        meta = d / "key.json"
        if not meta.exists():
            return None
        try:
            entry = json.loads(meta.read_text())
            listed, hashes = entry["files"], entry["sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not all((d / "files" / f).is_file() and f in hashes for f in listed):
            return None
        return [Path(f) for f in listed]

    def files_dir(self, key: CacheKey) -> Path:
        return self.entry_dir(key) / "files"

    def fetch(self, key: CacheKey, dest: Path) -> list[Path] | None:
        """Copy a cached graph's files into `dest` (files already there, shared with another bucket, are kept) and
        return them; None on a miss. Every file is hashed as copied (or, when kept, in the cache) and compared with
        the sha256 recorded at `store`; on a mismatch the copies are undone, the entry is removed so the recompile
        can store it again, and a warning names it."""
        d = self.entry_dir(key)
        if (listed := self.lookup(key)) is None:
            if d.exists():
                self._discard(d)  # incomplete or from before hashes were recorded: rewritten by the recompile
            return None
        hashes = json.loads((d / "key.json").read_text())["sha256"]
        copied: list[Path] = []
        for f in listed:
            target = dest / f
            if target.exists():
                got = sha256_file(self.files_dir(key) / f)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(self.files_dir(key) / f, target)
                copied.append(target)
                got = sha256_file(target)
            if got != hashes[str(f)]:
                for c in copied:
                    c.unlink(missing_ok=True)
                why = f"cache entry {d} failed its sha256 check ({f}: {got[:12]}, recorded {hashes[str(f)][:12]})"
                log.warning("%s; it is removed and the graph recompiled", why)
                self.rejected[key.digest] = why
                self._discard(d)
                return None
        return listed

    def _discard(self, d: Path) -> None:
        """Remove an entry: renamed aside first (atomic), so no other compile sees it half removed."""
        aside = self.root / f".discard-{d.name}-{os.getpid()}"
        try:
            os.replace(d, aside)
        except OSError:
            return  # already gone (another compile discarded it)
        shutil.rmtree(aside, ignore_errors=True)

    def store(self, key: CacheKey, src_dir: Path, files: list[Path]) -> None:
        """Copy `files` (relative to src_dir) into the cache atomically, with the sha256 of each copy."""
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.root))
        try:
            hashes = {}
            for f in files:
                dst = tmp / "files" / f
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src_dir / f, dst)
                hashes[str(f)] = sha256_file(dst)
            (tmp / "key.json").write_text(json.dumps({"fields": key.fields, "files": [str(f) for f in files],
                                                     "sha256": hashes}, indent=1, sort_keys=True, default=str))
            final = self.entry_dir(key)
            if final.exists():
                shutil.rmtree(tmp)
                return
            try:
                os.replace(tmp, final)
            except OSError:  # a concurrent compile of the same graph stored it since the check: keep that entry
                if not final.exists():
                    raise
                shutil.rmtree(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def explain_miss(self, key: CacheKey) -> str:
        """Which key fields differ from the closest cached entry for the same bucket (or why `fetch` refused the
        entry)."""
        if key.digest in self.rejected:
            return self.rejected[key.digest]
        best: list[str] | None = None
        if self.root.exists():
            for meta in self.root.glob("*/key.json"):
                try:
                    fields = json.loads(meta.read_text())["fields"]
                except (OSError, ValueError, KeyError):
                    continue
                if fields.get("bucket") != key.fields.get("bucket"):
                    continue
                diff = sorted(k for k in set(fields) | set(key.fields)
                              if _canon(fields.get(k)) != _canon(key.fields.get(k)))
                if best is None or len(diff) < len(best):
                    best = diff
        if best is None:
            return "new bucket (never compiled with any settings)"
        return "changed: " + ", ".join(best) if best else "entry incomplete"
