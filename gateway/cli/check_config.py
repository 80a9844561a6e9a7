"""`memgate check-config FILE`: validate a config and print its effective form, itself a
valid config (environment overrides applied)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from gateway.cli.exit_codes import EXIT_USAGE
from gateway.config.effective import effective_config
from gateway.config.rules import load_rules, missing_env
from gateway.errors import RulesError


def add_subcommand(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`memgate check-config` and its argument."""
    c = sub.add_parser("check-config", help="validate a config and print the effective one")
    c.add_argument("file", help="the YAML config to check (its effective form, printed on "
                                "stdout, is itself a valid config)")
    c.set_defaults(func=cmd_check_config)


def cmd_check_config(args: argparse.Namespace) -> int:
    """Prints the effective config as a config file: saved, it loads to the same rules."""
    try:
        rules = load_rules(Path(args.file), os.environ)
        problem = missing_env(rules, os.environ)
        if problem is not None:
            raise problem
    except RulesError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    print(f"# effective config of {args.file} (environment overrides applied)")
    print(yaml.safe_dump(effective_config(rules), sort_keys=False, allow_unicode=True), end="")
    print(f"# {args.file}: ok (mode={rules.memory.mode})", file=sys.stderr)
    return 0
