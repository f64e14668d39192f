"""`neuron-opt push ARTIFACT s3://bucket/prefix`: upload an artifact (verified first; the manifest last)."""

from __future__ import annotations

import argparse

from neuron_opt.commands.generate import add_s3_endpoint_flag


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("push", help="upload an artifact to S3 (or an S3-compatible store)")
    p.add_argument("artifact", help="artifact directory")
    p.add_argument("uri", help="s3://bucket/prefix to upload it to")
    p.add_argument("--force", action="store_true",
                   help="replace the artifact already at that prefix (its manifest goes first, so it is never "
                        "half-replaced; keys it listed that the new one does not are deleted, nothing else)")
    add_s3_endpoint_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from neuron_opt.object_store import push  # here: the CLI parses without the artifact readers (cryptography)

    loc = push(args.artifact, args.uri, endpoint_url=args.s3_endpoint_url, force=args.force)
    print(f"uploaded {args.artifact} to {loc}")
    return 0
