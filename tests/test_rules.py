"""Config loading: defaults, validation with file:line, env precedence, check-config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.errors import RulesError
from gateway.rules import load_rules

ROOT = Path(__file__).resolve().parent.parent


def test_shipped_config_loads_with_seed_defaults() -> None:
    """rules/gateway.yaml carries the seed's keys and safe defaults (eviction off, shadow on)."""
    r = load_rules(ROOT / "rules" / "gateway.yaml", {})
    assert r.memory.enable_eviction is False and r.memory.shadow is True
    assert r.memory.mode == "shadow"
    assert r.memory.budget.max_chars == 24000 and r.memory.budget.max_messages == 60
    assert r.memory.budget.max_turns == 20
    assert r.memory.eviction.order == ("pinned", "recent_turns", "compact_tools", "length")
    assert r.memory.eviction.compact.keep_recent == 1
    assert r.memory.eviction.max_pinned == 8 and r.memory.eviction.drop_unit == "turn"
    assert r.memory.markers.system_prefix == "[PIN]" and r.memory.markers.min_score == 0.7
    assert r.model_info("gpt-4o-mini").encoding == "o200k_base"
    assert r.model_info("gpt-4-0613").encoding == "cl100k_base"


@pytest.mark.parametrize(
    ("yaml_text", "line", "key", "reason"),
    [
        ("memory:\n  enable_evictoin: true\n", 2, "memory.enable_evictoin", "unknown key"),
        ("memory:\n  budget:\n    max_turns: twenty\n", 3, "memory.budget.max_turns",
         "must be an integer"),
        ("memory:\n  eviction:\n    order: [pinned, lenght]\n", 3, "memory.eviction.order",
         "unknown stage"),
        ("memory:\n  eviction:\n    drop_unit: message\n", 3, "memory.eviction.drop_unit",
         "must be one of turn, group"),
        ("memory:\n  markers:\n    min_score: 1.5\n", 3, "memory.markers.min_score",
         "between 0.0 and 1.0"),
        ("upstreams:\n  - name: a\n    base_url: ftp://x\n", 3, "upstreams[0].base_url",
         "http(s) URL"),
        ("memory: [1, 2\n", None, "<yaml>", "invalid YAML"),
    ],
)
def test_invalid_config_names_file_line_key_reason(
    tmp_path: Path, yaml_text: str, line: int | None, key: str, reason: str
) -> None:
    """Every refusal says where and why."""
    f = tmp_path / "bad.yaml"
    f.write_text(yaml_text)
    with pytest.raises(RulesError) as exc:
        load_rules(f, {})
    err = exc.value
    assert err.file == str(f) and err.key == key and reason in err.reason
    if line is not None:
        assert err.line == line
        assert str(err).startswith(f"{f}:{line}: {key}: ")


def test_env_precedence_and_invalid_env(tmp_path: Path) -> None:
    """MEMGATE_ENABLE_EVICTION and MEMGATE_UPSTREAM beat the file; junk values are refused."""
    f = tmp_path / "g.yaml"
    f.write_text("memory:\n  enable_eviction: false\n")
    r = load_rules(f, {"MEMGATE_ENABLE_EVICTION": "1", "MEMGATE_UPSTREAM": "http://up:9/"})
    assert r.memory.enable_eviction is True and r.default_upstream.base_url == "http://up:9"
    assert load_rules(f, {"MEMGATE_ENABLE_EVICTION": "0"}).memory.mode == "shadow"
    with pytest.raises(RulesError, match="MEMGATE_ENABLE_EVICTION"):
        load_rules(f, {"MEMGATE_ENABLE_EVICTION": "maybe"})


def test_missing_file_is_a_rules_error(tmp_path: Path) -> None:
    """A config that disappeared is refused like any other bad config."""
    with pytest.raises(RulesError, match="cannot read"):
        load_rules(tmp_path / "gone.yaml", {})


def test_check_config_cli(tmp_path: Path) -> None:
    """memgate check-config prints the effective config or file:line: key: reason, exit 1."""
    ok = subprocess.run([sys.executable, "-m", "gateway", "check-config",
                         str(ROOT / "rules" / "gateway.yaml")],
                        capture_output=True, text=True, env={"MEMGATE_ENABLE_EVICTION": "1"},
                        check=False)
    assert ok.returncode == 0
    assert "enable_eviction: true" in ok.stdout and "mode: 'on'" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("memory:\n  shadow: true\n  budget:\n    max_chars: -3\n")
    res = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(bad)],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 1
    assert res.stderr.strip() == f"{bad}:4: memory.budget.max_chars: must be >= 1, got -3"
