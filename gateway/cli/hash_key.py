"""`memgate hash-key`: the sha256 of a client key read from stdin, for
tenants.client_keys_sha256."""

from __future__ import annotations

import argparse
import sys

from gateway.cli.exit_codes import EXIT_USAGE
from gateway.errors import CommandError


def add_subcommand(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`memgate hash-key` (no arguments: the key comes on stdin)."""
    hk = sub.add_parser("hash-key", help="sha256 of a client key read from stdin, for "
                                         "tenants.client_keys_sha256")
    hk.set_defaults(func=cmd_hash_key)


def cmd_hash_key(args: argparse.Namespace) -> int:
    """Read from stdin (a key on the command line would stay in the shell history)."""
    from gateway.memory.session import credential, key_sha256

    text = sys.stdin.readline().strip()
    key = credential({"Authorization": text})
    if key is None:
        raise CommandError("no usable key on stdin (visible ASCII, optionally "
                           "'Bearer <key>')", EXIT_USAGE)
    print(key_sha256(key))
    return 0
