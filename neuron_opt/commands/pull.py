"""`neuron-opt pull s3://bucket/prefix`: download an artifact into the local artifact cache, verified (or copy it to
`--out`)."""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from neuron_opt.commands.generate import add_trusted_keys_flag


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="download an artifact from S3 (or an S3-compatible store), verified")
    p.add_argument("uri", help="s3://bucket/prefix of the artifact")
    p.add_argument("--out", type=Path, default=None,
                   help="also copy it to this directory (replaced only if it is an artifact or empty, as `compile "
                        "--out`); default: only the local artifact cache ($NEURON_OPT_CACHE_DIR/artifacts)")
    p.add_argument("--force", action="store_true", help="with --out: replace a non-empty directory that is not an "
                                                        "artifact (its contents are deleted)")
    add_trusted_keys_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # here: the CLI parses without the artifact readers (cryptography)
    from neuron_opt.artifact import check_out_dir
    from neuron_opt.object_store import pull

    if args.out is not None:
        check_out_dir(args.out, args.force)  # before the download
    local = pull(args.uri, endpoint_url=args.s3_endpoint_url, trusted_keys=args.trusted_keys)
    if args.out is None:
        print(f"pulled {args.uri} into {local}")
        return 0
    out = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        shutil.copytree(local, tmp, dirs_exist_ok=True)
        check_out_dir(out, args.force)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"pulled {args.uri} into {out}")
    return 0
