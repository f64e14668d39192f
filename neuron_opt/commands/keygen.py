"""`neuron-opt keygen --out DIR`: an Ed25519 key pair for signing artifacts (`compile --sign-key`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keygen", help="make an Ed25519 key pair to sign artifacts with")
    p.add_argument("--out", required=True, type=Path,
                   help="directory for signing.key (private, mode 0600) and signing.pub; an existing key is never "
                        "overwritten")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from neuron_opt.signing import generate_keypair  # here: the CLI parses without cryptography

    private, public, fingerprint = generate_keypair(args.out)
    print(f"private key: {private} (keep it secret: `neuron-opt compile --sign-key {private}`)")
    print(f"public key:  {public} (give it to those who load the artifacts: `--trusted-keys {public}`)")
    print(f"fingerprint: {fingerprint}")
    return 0
