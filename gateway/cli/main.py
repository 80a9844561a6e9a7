"""`memgate` command line: the top-level parser, `main()`, and how a failure is reported.

Each subcommand's module adds its own subparser (serve, check_config, evict, stats_command,
memory, hash_key, replay_command); `demo`'s stays here, so that no other command loads the
mock upstream and the samples. Whatever a subcommand raises ends here: a user error is one
line on stderr naming what and where, never a traceback, with the exit code exit_codes.py
lists.
"""

from __future__ import annotations

import argparse
import sys

from gateway import __version__
from gateway.cli import (
    check_config,
    evict,
    hash_key,
    memory,
    replay_command,
    serve,
    stats_command,
)
from gateway.cli.exit_codes import EXIT_FAILED, EXIT_USAGE
from gateway.errors import CommandError, RulesError


def cmd_demo(args: argparse.Namespace) -> int:
    """memgate demo (imported here: `serve` does not load the mock upstream and samples)."""
    from gateway.cli import demo

    return demo.run(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="memgate", usage="memgate [-h] [--version] COMMAND [ARGS ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit codes: 0 ok, 1 the command failed (port in use, upstream error, nothing "
               "measured), 2 usage or config error (wrong flag, missing file, invalid config)")
    ap.add_argument("--version", action="version", version=f"memgate {__version__}")
    # listed once, in the description (with their help), not again as a positional
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND", prog="memgate",
                            help=argparse.SUPPRESS)

    serve.add_subcommand(sub)
    d = sub.add_parser("demo", help="gateway + mock upstream + samples, offline")
    d.add_argument("--samples", default=None, help="directory of sample payloads")
    d.add_argument("--config", default=None, help="config to start from (copied, then flipped)")
    d.set_defaults(func=cmd_demo)
    check_config.add_subcommand(sub)
    evict.add_subcommand(sub)
    stats_command.add_subcommand(sub)
    memory.add_subcommand(sub)
    hash_key.add_subcommand(sub)
    replay_command.add_subcommand(sub)
    ap.description = ("memgate: a memory-aware reverse proxy for LLM APIs.\n\ncommands:\n"
                      + "\n".join(f"  {name:<13} {a.help}" for name, a in
                                  zip(sub.choices, sub._choices_actions, strict=True)))
    _own_usage(ap)
    return ap


def _own_usage(parser: argparse.ArgumentParser) -> None:
    """Each (sub)command remembers its parser, so a wrong flag shows that command's usage."""
    parser.set_defaults(_parser=parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _own_usage(child)


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if extra:
        args._parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        result: int = args.func(args)
    except CommandError as exc:
        return _fail(args, str(exc), exc.code)
    except RulesError as exc:
        return _fail(args, f"invalid config: {exc}", EXIT_USAGE)
    except OSError as exc:  # a file the user named: missing, a directory, unreadable
        where = f"{exc.filename}: " if exc.filename else ""
        return _fail(args, f"{where}{exc.strerror or exc}", EXIT_USAGE if where else EXIT_FAILED)
    except KeyboardInterrupt:
        return 130
    return result


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    sub = " ".join(str(v) for k in ("command", "memory_command", "replay_command")
                   if (v := getattr(args, k, None)))
    print(f"memgate {sub}: {message}", file=sys.stderr)
    return code
