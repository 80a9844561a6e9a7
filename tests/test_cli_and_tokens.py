"""memgate evict / demo as a user runs them, and the offline tokenizer choice."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import tiktoken_ext

from gateway.tokens import FALLBACK, TokenCounter, load_encoding

ROOT = Path(__file__).resolve().parent.parent
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"


def memgate(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MEMGATE_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "gateway", *args], capture_output=True,
                          text=True, env=full_env, cwd=ROOT, timeout=120, check=False)


def test_evict_table_explains_each_message() -> None:
    """The table lists every message with kept/dropped and the stage, then totals."""
    res = memgate("evict", "samples/chat_long_tools.json",
                  env={"MEMGATE_ENABLE_EVICTION": "1"})
    assert res.returncode == 0, res.stderr
    rows = [ln for ln in res.stdout.splitlines() if ln[:4].strip().isdigit()]
    assert len(rows) == 154
    assert "kept    pinned" in rows[1] and "dropped length" in rows[2]
    # 72 of the dropped messages come back for the question (recall_share, README)
    assert "messages 154 -> 99 (dropped 55)" in res.stdout and "recalled=72" in res.stdout
    assert sum(" recalled" in r for r in rows) == 72
    assert "carry-over note (1 fields)" in res.stdout


def test_evict_json_is_the_forwarded_body() -> None:
    """--json prints exactly what the gateway would forward under the config's mode."""
    on = memgate("evict", "samples/chat_long_tools.json", "--json",
                 env={"MEMGATE_ENABLE_EVICTION": "1"})
    body = orjson.loads(on.stdout)
    assert len(body["messages"]) == 99 + 1  # + the carry-over note
    assert body["messages"][-2]["content"].startswith("[memgate memory]")
    off = memgate("evict", "samples/chat_long_tools.json", "--json")
    original = (ROOT / "samples" / "chat_long_tools.json").read_bytes()
    assert off.stdout.encode() == original + b"\n"


def test_demo_runs_offline_and_shows_before_after() -> None:
    """memgate demo: mock upstream + gateway + samples, shadow then on via hot reload."""
    res = memgate("demo")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert out.count("[mem] ") == 2 * len(list((ROOT / "samples").glob("*.json")))
    assert "mode=shadow" in out and "mode=on" in out
    assert "config_reload result=ok" in out
    row = next(ln for ln in out.splitlines() if ln.startswith("chat_long_tools "))
    cols = row.split()
    assert cols[1] == "154" and cols[5] == "54" and cols[7] == "100"


def test_fallback_encoding_is_explicit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without the file in TIKTOKEN_CACHE_DIR the offline cl100k serves, and says so."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    _, name = load_encoding("o200k_base")
    assert name == FALLBACK


def test_real_encoding_from_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A real encoding file in TIKTOKEN_CACHE_DIR is used (hash-checked by tiktoken)."""
    data = Path(tiktoken_ext.__path__[0]) / "data" / "cl100k_base.tiktoken"
    shutil.copy(data, tmp_path / hashlib.sha1(CL100K_URL.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    enc, name = load_encoding("cl100k_base")
    assert name == "cl100k_base" and enc.name == "cl100k_base"


def test_token_cache_is_bounded_lru() -> None:
    """Counts are cached by content, at most cache_size entries, least recent evicted."""
    enc, name = load_encoding(FALLBACK)
    c = TokenCounter(enc, name, cache_size=2)
    assert c.count("hello world") == 2
    c.count("a b c")
    c.count("hello world")  # refresh
    c.count("third")
    assert len(c) == 2
    assert c.stats.misses == 3 and c.stats.hits == 1
    c.count("hello world")
    assert c.stats.hits == 2  # still cached: "a b c" was the least recent
