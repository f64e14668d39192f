"""Content-addressed compile cache: one entry per bucket graph.

The key of a bucket's graph hashes every input that can change the compiled code: the weights' fingerprint, the
model/parallel/cache config, the bucket, the backend and its options (compiler flags), the dtype and the versions.
A recompile with one bucket added compiles only that bucket; on a miss, `explain_miss` names the key fields that
differ from the closest earlier entry of the same bucket, so users see *why* a compile was not cached.

Entries are written atomically (temp directory + rename); a half-written entry is never visible.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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

    def entry_dir(self, key: CacheKey) -> Path:
        return self.root / key.digest

    def lookup(self, key: CacheKey) -> list[Path] | None:
        """Files of a cached graph (relative to the entry dir), or None on a miss."""
        d = self.entry_dir(key)
        meta = d / "key.json"
        if not meta.exists():
            return None
        listed = json.loads(meta.read_text()).get("files", [])
        if not all((d / "files" / f).exists() for f in listed):
            return None
        return [Path(f) for f in listed]

    def files_dir(self, key: CacheKey) -> Path:
        return self.entry_dir(key) / "files"

    def store(self, key: CacheKey, src_dir: Path, files: list[Path]) -> None:
        """Copy `files` (relative to src_dir) into the cache atomically."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.root))
        try:
            for f in files:
                dst = tmp / "files" / f
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src_dir / f, dst)
            (tmp / "key.json").write_text(json.dumps({"fields": key.fields, "files": [str(f) for f in files]},
                                                     indent=1, sort_keys=True, default=str))
            final = self.entry_dir(key)
            if final.exists():
                shutil.rmtree(tmp)
                return
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def explain_miss(self, key: CacheKey) -> str:
        """Which key fields differ from the closest cached entry for the same bucket."""
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
