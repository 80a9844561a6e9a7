"""`memgate stats PATHS`: the command around stats.py's measuring (read the config, print
the summary as a table or JSON, write the --plot PNG, pick the exit code)."""

from __future__ import annotations

import argparse
import os
import sys

import orjson

from gateway.cli.exit_codes import EXIT_FAILED, EXIT_USAGE
from gateway.config.resources import default_config
from gateway.config.rules import load_rules
from gateway.errors import CommandError
from gateway.observe.capture import SIDES


def add_subcommand(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`memgate stats` and its flags."""
    st = sub.add_parser("stats", help="measure saved payloads / [mem] logs (and a policy)")
    st.add_argument("paths", nargs="+", help="payload / capture JSON files, JSONL, [mem] log "
                    "files (docker/kubectl prefixes welcome), directories, or -")
    st.add_argument("--config", default=None, help="also simulate this config's policy")
    st.add_argument("--json", action="store_true", help="print the summary as JSON")
    st.add_argument("--plot", default=None, metavar="PNG",
                    help="write a tokens histogram PNG: p50/p90/p99, the budget (matplotlib)")
    st.add_argument("--log", action="store_true", help="--plot with a log-scaled tokens axis")
    st.add_argument("--side", choices=SIDES, default="before",
                    help="capture files: measure what the client sent (before, the default) "
                         "or what the gateway forwarded (after)")
    st.set_defaults(func=cmd_stats)


def cmd_stats(args: argparse.Namespace) -> int:
    from gateway.cli import stats

    env = dict(os.environ)
    rules = load_rules(default_config(args.config, env), env)
    report = stats.measure(args.paths, rules, simulate=args.config is not None,
                           progress=sys.stderr if sys.stderr.isatty() else None,
                           side=args.side)
    summary = stats.summary(report)
    if args.json:
        summary["skipped_detail"] = report.skipped[:100]
        sys.stdout.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(stats.render_table(summary))
        for why in report.skipped[:10]:
            print(f"skipped: {why}", file=sys.stderr)
    if args.plot:
        source = " ".join(args.paths) + f"  ({stats.describe_sources(summary['sources'])})"
        error = stats.plot(report, args.plot, report.budget_tokens, source, log=args.log)
        if error:  # nothing measured is the command failing; no matplotlib, a usage error
            raise CommandError(error, EXIT_FAILED if not report.samples else EXIT_USAGE)
    return 0 if report.samples else 1
