"""docs/configuration.md stays true: it lists every key of the shipped config, and nothing else.

The page's keys are the backticked dotted paths in the first column of its tables whose
header's first cell is `key`. The shipped file's keys are rules/gateway.yaml flattened to
dotted paths: a mapping is walked, a list of mappings (the upstreams) is walked as `key[]`,
the loader's own spelling, and any other list (stage names, path or model globs) is one key.
The few keys the loader accepts that the shipped file cannot write with their default
value are listed in NOT_SHIPPED, and the page says why in a section of its own.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from gateway.config.effective import effective_config
from gateway.config.rules import load_rules

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration.md"
SHIPPED = ROOT / "rules" / "gateway.yaml"

# default "not set", and the loader refuses null for them (a string is required), so the
# shipped file can only show them as comments; memory.write is memory.carry's alias,
# session.header the older spelling of session.id_from's first source
NOT_SHIPPED = frozenset({"memory.write", "memory.carry.rules_file", "tokens.models_file",
                         "upstreams[].api_key_env", "upstreams[].proxy", "session.header"})
NOT_SHIPPED_SECTION = "## Keys documented here but not in the shipped file"
_ROW_KEY = re.compile(r"^\|\s*`([^`]+)`\s*\|")


def flatten(data: Any, prefix: str = "") -> set[str]:
    """Dotted key paths of a parsed config (see the module docstring)."""
    if isinstance(data, dict):
        keys: set[str] = set()
        for k, v in data.items():
            keys |= flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return keys
    if isinstance(data, list) and data and all(isinstance(x, dict) for x in data):
        return set().union(*(flatten(item, f"{prefix}[]") for item in data))
    return {prefix}


def page_keys(text: str) -> list[str]:
    """The keys in the first column of the page's `| key | ...` tables, in page order."""
    keys: list[str] = []
    in_key_table = False
    for line in text.splitlines():
        if not line.startswith("|"):
            in_key_table = False
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == "key":
            in_key_table = True
            continue
        if in_key_table and (m := _ROW_KEY.match(line)):
            keys.append(m.group(1))
    return keys


def shipped_keys() -> set[str]:
    return flatten(yaml.safe_load(SHIPPED.read_text(encoding="utf-8")))


def test_every_documented_key_is_shipped_and_every_shipped_key_documented() -> None:
    listed = page_keys(PAGE.read_text(encoding="utf-8"))
    assert len(listed) == len(set(listed)), sorted(k for k in listed if listed.count(k) > 1)
    documented, shipped = set(listed), shipped_keys()
    assert sorted(shipped - documented) == [], "keys of rules/gateway.yaml missing from the page"
    assert sorted(documented - shipped) == sorted(NOT_SHIPPED), (
        "keys on the page but not in rules/gateway.yaml (document why, in NOT_SHIPPED "
        "and the page's own section)")


def test_the_page_says_why_each_unshipped_key_is_not_shipped() -> None:
    text = PAGE.read_text(encoding="utf-8")
    assert NOT_SHIPPED_SECTION in text
    section = text.split(NOT_SHIPPED_SECTION, 1)[1].split("\n## ", 1)[0]
    assert {k for k in NOT_SHIPPED if f"`{k}`" in section} == NOT_SHIPPED


def test_the_page_lists_every_key_the_loader_prints() -> None:
    """The loader's side: what `memgate check-config` prints for the shipped file is the
    page's keys, but for the two optional upstream keys it prints only when set and the
    alias and the older spelling it never prints."""
    printed = flatten(effective_config(load_rules(SHIPPED, {})))
    documented = set(page_keys(PAGE.read_text(encoding="utf-8")))
    assert sorted(documented ^ printed) == sorted(
        {"memory.write", "upstreams[].api_key_env", "upstreams[].proxy", "session.header"})


def test_flatten_and_the_page_reader_on_small_inputs() -> None:
    """A list of mappings is walked as key[]; other lists are one key; only `key` tables
    count, and a table ends at the first line that is not a row."""
    data = {"a": {"b": 1, "c": [1, 2], "d": []},
            "ups": [{"name": "x", "paths": ["/*"]}, {"name": "y", "proxy": "http://p"}]}
    assert flatten(data) == {"a.b", "a.c", "a.d", "ups[].name", "ups[].paths", "ups[].proxy"}
    text = ("| key | default |\n|---|---|\n| `a.b` | 1 |\n| `a.c` | 2 |\n\n"
            "| variable | what |\n|---|---|\n| `NOT_A_KEY` | x |\n")
    assert page_keys(text) == ["a.b", "a.c"]
