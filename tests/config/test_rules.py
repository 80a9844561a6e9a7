"""Config loading: defaults, validation with file:line, env precedence, check-config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config.rules import load_rules
from gateway.errors import RulesError

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_config_loads_with_seed_defaults() -> None:
    """rules/gateway.yaml carries the seed's keys and safe defaults (eviction off, shadow on)."""
    r = load_rules(ROOT / "rules" / "gateway.yaml", {})
    assert r.memory.enable_eviction is False and r.memory.shadow is True
    assert r.memory.mode == "shadow"
    assert r.memory.budget.max_chars is None and r.memory.budget.max_messages == 400
    assert r.memory.budget.max_turns == 200
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


@pytest.mark.slow
def test_check_config_cli(tmp_path: Path) -> None:
    """memgate check-config prints the effective config or file:line: key: reason, exit 2."""
    ok = subprocess.run([sys.executable, "-m", "gateway", "check-config",
                         str(ROOT / "rules" / "gateway.yaml")],
                        capture_output=True, text=True, env={"MEMGATE_ENABLE_EVICTION": "1"},
                        check=False)
    assert ok.returncode == 0
    assert "enable_eviction: true" in ok.stdout and "ok (mode=on)" in ok.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("memory:\n  shadow: true\n  budget:\n    max_chars: -3\n")
    res = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(bad)],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 2
    assert res.stderr.strip() == f"{bad}:4: memory.budget.max_chars: must be >= 1, got -3"


# The seeds' own config blocks, pasted as the seeds write them (comments included).
SEED_000_MEMORY_WRITE = """\
memory:
  write:
    keep_fields: [task_state, resolved_refs, confirmed_constraints, output_file]
    drop_when:
      task_closed: true
      no_pending_reference: true
      small_talk_only: true
    ref_ttl_turns: 3   # 占位值，按会话长度调整
    log_skipped: true  # 便于回放时核对丢弃是否发生
"""
SEED_003_PARAMETERS = """\
write_granularity: turn          # turn | message | session
session_scope: current           # current | cross_session
default_time_window: 7d
default_tags: []
max_chars_per_record: <n>        # 按模型上下文留余量
search_top_k: 5
time_boundary: half_open         # closed | half_open
"""


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", "check-config", str(path)],
                          capture_output=True, text=True, check=False, cwd=ROOT, timeout=60)


@pytest.mark.slow
def test_seed_000_memory_write_block_is_the_carry_section(tmp_path: Path) -> None:
    """000's `memory.write` skeleton loads as memory.carry (its alias) with the seed's values,
    through the loader and through `memgate check-config`."""
    (tmp_path / "carry.yaml").write_bytes((ROOT / "rules" / "carry.yaml").read_bytes())
    cfg = tmp_path / "g.yaml"
    cfg.write_text(SEED_000_MEMORY_WRITE, encoding="utf-8")
    carry = load_rules(cfg, {}).memory.carry
    assert carry.enabled is True
    assert carry.keep_fields == ("task_state", "resolved_refs", "confirmed_constraints",
                                 "output_file")
    assert (carry.task_closed, carry.no_pending_reference, carry.small_talk_only) == (
        True, True, True)
    assert carry.ref_ttl_turns == 3 and carry.log_skipped is True
    res = check_config(cfg)
    assert res.returncode == 0, res.stderr
    assert "ref_ttl_turns: 3" in res.stdout and "log_skipped: true" in res.stdout


def test_memory_write_and_carry_together_name_both(tmp_path: Path) -> None:
    """Both spellings of the one section are refused, naming both and their lines."""
    cfg = tmp_path / "g.yaml"
    cfg.write_text("memory:\n  carry:\n    ref_ttl_turns: 2\n" + SEED_000_MEMORY_WRITE[8:])
    with pytest.raises(RulesError) as exc:
        load_rules(cfg, {})
    assert exc.value.key == "memory.write" and exc.value.line == 4
    assert "memory.carry (line 2)" in exc.value.reason and "alias" in exc.value.reason


def test_memory_write_errors_name_the_spelling_used(tmp_path: Path) -> None:
    """A bad value under memory.write is reported as memory.write.<key> at its line."""
    cfg = tmp_path / "g.yaml"
    cfg.write_text(SEED_000_MEMORY_WRITE.replace("ref_ttl_turns: 3", "ref_ttl_turns: x"))
    with pytest.raises(RulesError) as exc:
        load_rules(cfg, {})
    assert exc.value.key == "memory.write.ref_ttl_turns" and exc.value.line == 8


@pytest.mark.slow
def test_missing_carry_patterns_file_falls_back_or_is_explained(tmp_path: Path) -> None:
    """The seed block pasted into a config with no carry.yaml beside it uses the shipped
    patterns; a rules_file that is named but absent is refused with its key and path."""
    cfg = tmp_path / "g.yaml"
    cfg.write_text(SEED_000_MEMORY_WRITE, encoding="utf-8")
    res = check_config(cfg)
    assert res.returncode == 0, res.stderr
    assert load_rules(cfg, {}).carry_path == str((ROOT / "rules" / "carry.yaml").resolve())
    cfg.write_text(SEED_000_MEMORY_WRITE + "    rules_file: my-carry.yaml\n", encoding="utf-8")
    res = check_config(cfg)
    assert res.returncode == 2
    assert res.stderr.startswith(f"{cfg}:10: memory.write.rules_file: "), res.stderr
    assert str(tmp_path / "my-carry.yaml") in res.stderr and "does not exist" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_seed_003_parameters_at_the_top_level_say_where_they_live(tmp_path: Path) -> None:
    """003's parameter list pasted at the top level is refused with where each key lives."""
    cfg = tmp_path / "g.yaml"
    cfg.write_text(SEED_003_PARAMETERS, encoding="utf-8")
    res = check_config(cfg)
    assert res.returncode == 2
    first = f"{cfg}:1: write_granularity: unknown key here; it belongs under store:"
    assert res.stderr.startswith(first), res.stderr
    for key in ("session_scope", "default_time_window", "default_tags", "search_top_k",
                "time_boundary", "max_chars_per_record"):
        assert key in res.stderr


@pytest.mark.parametrize(("yaml_text", "key", "home"), [
    ("enable_eviction: true\n", "enable_eviction", "memory:"),
    ("memory:\n  max_tokens: 100\n", "memory.max_tokens", "memory.budget:"),
    ("store:\n  top_k: 3\n", "store.top_k", "store.recall:"),
    ("memory:\n  keep_fields: [refs]\n", "memory.keep_fields", "memory.carry:"),
    ("logging:\n  max_body_bytes: 2048\n", "logging.max_body_bytes", "limits:"),
    ("store:\n  memory: {}\n", "store.memory", "the top level"),
])
def test_a_key_of_another_section_names_that_section(
    tmp_path: Path, yaml_text: str, key: str, home: str
) -> None:
    """A key that exists elsewhere is refused with the section it belongs to."""
    cfg = tmp_path / "g.yaml"
    cfg.write_text(yaml_text)
    with pytest.raises(RulesError) as exc:
        load_rules(cfg, {})
    assert exc.value.key == key
    assert exc.value.reason.startswith("unknown key here; it belongs ") and home in exc.value.reason


@pytest.mark.slow
def test_seed_003_parameters_under_store_are_accepted(tmp_path: Path) -> None:
    """The same list indented under `store:` (its placeholder filled in) loads as written."""
    cfg = tmp_path / "g.yaml"
    block = SEED_003_PARAMETERS.replace("<n>", "4000")
    cfg.write_text("store:\n" + "".join(f"  {ln}\n" for ln in block.splitlines()),
                   encoding="utf-8")
    s = load_rules(cfg, {}).store
    assert (s.write_granularity, s.session_scope, s.default_time_window_s, s.default_tags,
            s.max_chars_per_record, s.search_top_k, s.time_boundary) == (
        "turn", "current", 7 * 86400, (), 4000, 5, "half_open")
    res = check_config(cfg)
    assert res.returncode == 0, res.stderr
    assert "default_tags: []" in res.stdout
    cfg.write_text("store:\n  default_tags: [proj-x, 预算]\n", encoding="utf-8")
    assert load_rules(cfg, {}).store.default_tags == ("proj-x", "预算")
    for bad in ("[1]", "['']", "{a: 1}", f"[{'x' * 300}]"):
        cfg.write_text(f"store:\n  default_tags: {bad}\n")
        with pytest.raises(RulesError) as exc:
            load_rules(cfg, {})
        assert exc.value.key == "store.default_tags" and exc.value.line == 2


@pytest.mark.parametrize("url,why", [
    ("http://127.0.0.1:99999", "port out of range"),
    ("http://bad host:80", "valid host"),
    ("http://127.0.0.1:0", "valid host"),
    ("ftp://u:pw-SECRET@example.com", "http(s) URL"),
])
def test_an_upstream_no_request_could_reach_is_refused(
    tmp_path: Path, url: str, why: str
) -> None:
    """A base URL every request would fail on (a port past 65535, a host with a space)
    is refused at load, naming the key, and its password is never said; from the
    environment too."""
    path = tmp_path / "gateway.yaml"
    path.write_text(f"upstreams:\n  - name: openai\n    base_url: '{url}'\n    paths: ['/*']\n")
    with pytest.raises(RulesError) as exc:
        load_rules(path, {})
    assert why in str(exc.value) and "base_url" in str(exc.value.key)
    assert "SECRET" not in str(exc.value)
    with pytest.raises(RulesError) as env_exc:
        load_rules(None, {"MEMGATE_UPSTREAM": url})
    assert why in str(env_exc.value) and "SECRET" not in str(env_exc.value)
