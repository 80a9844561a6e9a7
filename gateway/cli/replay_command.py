"""`memgate replay ab|expect`: the commands around replay.py (A/B against an upstream) and
expect.py (per-turn expectations): read the config, map their errors to exit codes."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from gateway.cli.exit_codes import EXIT_FAILED, EXIT_USAGE, aiohttp_errors
from gateway.config.resources import default_config
from gateway.config.rules import load_rules
from gateway.errors import CommandError
from gateway.observe.capture import SIDES


def add_subcommand(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`memgate replay` and its subcommands ab and expect."""
    rp = sub.add_parser("replay", help="replay conversations: ab (A/B), expect (per turn)")
    rsub = rp.add_subparsers(dest="replay_command", required=True)
    ab = rsub.add_parser("ab", help="A (no eviction) vs B (a policy) on one long conversation")
    ab.add_argument("conversation", help="chat payload JSON (the long history), or a capture "
                                         "file (its --side)")
    ab.add_argument("--probes", required=True, help="YAML list of probe questions")
    ab.add_argument("--upstream", required=True, help="OpenAI-compatible base URL to ask")
    ab.add_argument("--config", default=None, help="the policy for B (default rules)")
    ab.add_argument("--repeat", type=int, default=1, help="runs per probe (stability)")
    ab.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""),
                    help="key for the upstream (default $OPENAI_API_KEY)")
    ab.add_argument("--out", default="replay-report", help="directory for report.md/.html")
    ab.add_argument("--as-configured", action="store_true",
                    help="B forwards as the config stands (kill switch included): "
                         "checks a rollback")
    ab.add_argument("--concurrency", type=int, default=4,
                    help="upstream calls in flight at once (4); each call is a progress line")
    ab.add_argument("--side", choices=SIDES, default="before",
                    help="a capture file: replay what the client sent (before, the default) or "
                         "what the gateway forwarded (after)")
    ab.set_defaults(func=cmd_replay_ab)
    ex = rsub.add_parser("expect", help="per-turn replay of a session against expectations")
    ex.add_argument("session", help="JSONL: {turn, role, text} per line")
    ex.add_argument("expect", help="YAML: turn -> {must_contain: {key: value}, must_not_contain}")
    ex.add_argument("--config", default=None, help="config whose memory.carry rules replay")
    ex.add_argument("--self-check", action="store_true",
                    help="also corrupt each expectation and require the run to fail")
    ex.set_defaults(func=cmd_replay_expect)


def cmd_replay_ab(args: argparse.Namespace) -> int:
    from gateway.cli import replay

    env = dict(os.environ)
    rules = load_rules(default_config(args.config, env), env)
    try:
        return replay.main(args, rules)
    except (aiohttp_errors(), TimeoutError) as exc:  # before OSError: some are OSErrors too
        why = str(exc) or "no answer in time"
        raise CommandError(f"upstream {replay.shown_url(args.upstream)}: {why}",
                           EXIT_FAILED) from None
    except RuntimeError as exc:  # the upstream answered an error
        raise CommandError(str(exc), EXIT_FAILED) from None
    except ValueError as exc:  # the conversation, the probes or a flag
        raise CommandError(str(exc), EXIT_USAGE) from None


def cmd_replay_expect(args: argparse.Namespace) -> int:
    from gateway.cli import expect

    env = dict(os.environ)
    rules = load_rules(default_config(args.config, env), env)
    patterns = rules.memory.carry_patterns
    if patterns is None:
        raise CommandError(f"{rules.source or 'the config'} has no memory.carry section",
                           EXIT_USAGE)
    try:  # a missing or unreadable file: main names it (exit 2)
        session = expect.load_session(Path(args.session))
        expectations = expect.load_expectations(Path(args.expect))
    except ValueError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    lines = expect.run(session, expectations, patterns, rules.memory.carry)
    print("\n".join(lines))
    failed = any(" FAIL" in ln for ln in lines)
    if args.self_check:
        for name, bad in expect.corruptions(expectations):
            bad_lines = expect.run(session, bad, patterns, rules.memory.carry)
            caught = any(" FAIL" in ln for ln in bad_lines)
            print(f"self-check {name}: {'caught' if caught else 'NOT CAUGHT'}")
            failed = failed or not caught
    return 1 if failed or not lines else 0
