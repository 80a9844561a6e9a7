"""memgate evict / demo as a user runs them, and the offline tokenizer choice."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import tiktoken_ext

from gateway.measure.tokens import FALLBACK, TokenCounter, load_encoding

ROOT = Path(__file__).resolve().parents[2]
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"


def memgate(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MEMGATE_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "gateway", *args], capture_output=True,
                          text=True, env=full_env, cwd=ROOT, timeout=120, check=False)


@pytest.mark.slow
def test_evict_table_explains_each_message() -> None:
    """The table lists every message with kept/dropped and the stage, then totals."""
    res = memgate("evict", "samples/chat_long_tools.json",
                  env={"MEMGATE_ENABLE_EVICTION": "1"})
    assert res.returncode == 0, res.stderr
    rows = [ln for ln in res.stdout.splitlines() if ln[:4].strip().isdigit()]
    assert len(rows) == 154
    assert "kept    pinned" in rows[1] and "dropped length" in rows[2]
    # 78 of the dropped messages come back: the tool turns' requests, then what the
    # question is about (recall_share, README); the carry note's line naming the dropped
    # turns' retrieval handle takes a little of the budget (memory.retrieve, shipped on)
    assert "messages 154 -> 105 (dropped 49)" in res.stdout and "recalled=78" in res.stdout
    assert sum(" recalled" in r for r in rows) == 78
    # the task state, the last task's conclusion and the files its tool calls touched
    assert "carry-over note (3 fields)" in res.stdout
    assert "- last task concluded: Orders: 12 partitions" in res.stdout


@pytest.mark.slow
def test_evict_json_is_the_forwarded_body() -> None:
    """--json prints exactly what the gateway would forward under the config's mode."""
    on = memgate("evict", "samples/chat_long_tools.json", "--json",
                 env={"MEMGATE_ENABLE_EVICTION": "1"})
    body = orjson.loads(on.stdout)
    assert len(body["messages"]) == 105 + 1  # + the carry-over note
    assert body["messages"][-2]["content"].startswith("[memgate memory]")
    # the retrieval tool after the client's own, its handle named in the note
    assert [t["function"]["name"] for t in body["tools"]] == ["list_dir", "memgate_retrieve"]
    assert 'call memgate_retrieve with handle "hist-' in body["messages"][-2]["content"]
    off = memgate("evict", "samples/chat_long_tools.json", "--json")
    original = (ROOT / "samples" / "chat_long_tools.json").read_bytes()
    assert off.stdout.encode() == original + b"\n"


@pytest.mark.slow
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
    # shadow would drop 45 (the budget counts the history on top of the floor: system and
    # the current turn, fixed_tokens=84), eviction on forwards 106 (with the carry note)
    assert cols[1] == "154" and cols[5] == "45" and cols[7] == "106"


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


def free_port() -> int:
    """A loopback port nothing listens on (bound, then released): connecting is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli_errors(tmp: Path) -> list[tuple[list[str], int, str]]:
    """(argv, exit code, how stderr's one line starts) of user errors of evict, stats,
    replay and memory: 2 for what the user gives, 1 for what failed when it ran."""
    bad_cfg, no_carry, db = tmp / "bad.yaml", tmp / "nocarry.yaml", tmp / "m.db"
    bad_cfg.write_text("memory:\n  budget:\n    max_tokens: -3\n")
    no_carry.write_text(f"store:\n  path: {db}\nmemory:\n  carry: null\n")
    (tmp / "x.json").write_text("{not json")
    (tmp / "empty.jsonl").write_text("")
    dead = f"http://127.0.0.1:{free_port()}"
    mem = ["memory", "--config", str(no_carry), "--api-key", "k1"]
    return [
        (["evict", str(tmp / "x.json")], 2, f"memgate evict: {tmp / 'x.json'}: not JSON: "),
        (["evict", "samples/chat_short.json", "--config", str(bad_cfg)], 2,
         f"memgate evict: invalid config: {bad_cfg}:"),
        (["stats", str(tmp / "empty.jsonl"), "--plot", str(tmp / "p.png")], 1,
         "memgate stats: --plot: no request was measured"),
        (["replay", "expect", "samples/carry/x.jsonl", "samples/carry/x.yaml", "--config",
          str(no_carry)], 2, f"memgate replay expect: {no_carry} has no memory.carry section"),
        (["replay", "ab", "samples/chat_short.json", "--probes", "samples/probes_lost_fact.yaml",
          "--upstream", dead, "--out", str(tmp / "r")], 1, f"memgate replay ab: upstream {dead}"),
        (["replay", "ab", str(tmp / "x.json"), "--probes", "samples/probes_lost_fact.yaml",
          "--upstream", dead], 2, f"memgate replay ab: {tmp / 'x.json'}: not JSON"),
        (["memory", "--config", str(no_carry), "search", "--session-id", "s"], 2,
         "memgate memory search: whose records? give --api-key"),
        ([*mem, "write", "{oops"], 2, "memgate memory write: the record is not JSON: "),
        ([*mem, "search", "--filter", "[1", "--session-id", "s"], 2,
         "memgate memory search: --filter: not JSON: "),
        ([*mem, "search", "--filter", "[1]"], 2,
         "memgate memory search: --filter: must be a JSON object"),
        ([*mem, "get", "nope"], 1, "memgate memory get: no memory 'nope' for this key"),
        ([*mem, "--url", dead, "get", "nope"], 1, f"memgate memory get: cannot reach {dead}: "),
    ]


def test_command_errors_are_one_line_with_the_readmes_exit_code(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Every user error of evict / stats / replay / memory is one stderr line naming the
    command, no traceback, no output, exit 2 (usage/config) or 1 (it ran and failed)."""
    from gateway.cli.main import main

    for argv, code, start in cli_errors(tmp_path):
        capsys.readouterr()
        try:
            got = main(argv)
        except SystemExit as exc:  # an argparse error would be one
            got = int(exc.code or 0)
        out, err = capsys.readouterr()
        lines = [ln for ln in err.splitlines() if not ln.startswith("replay ab: [")]
        assert (got, len(lines)) == (code, 1), (argv, got, err)  # [i/n]: ab's progress
        assert lines[0].startswith(start) and "Traceback" not in err, (argv, err)
        assert out == "" or argv[0] == "stats", (argv, out)


@pytest.mark.slow
def test_serve_logs_no_upstream_password_or_query() -> None:
    """An upstream URL with user:password (an internal proxy behind basic auth) or a key
    in its query: the startup line names the upstream without them."""
    import time

    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMGATE_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--port", str(free_port()), "--upstream",
         "http://user:pw-SECRET@127.0.0.1:9/v1?api_key=k-SECRET"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    assert proc.stdout is not None
    seen: list[bytes] = []
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            seen.append(line)
            if b"config_loaded" in line or not line:
                break
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()
    out = b"".join(seen)
    assert b"config_loaded" in out and b"127.0.0.1:9" in out, out[-500:]
    assert b"SECRET" not in out


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["replay", "ab", "{conv}", "--probes", "{bad}", "--upstream", "http://127.0.0.1:9",
     "--out", "{out}"],
    ["replay", "expect", "samples/carry/case_a_zh.jsonl", "{bad}"],
    ["demo", "--config", "{bad}"],
    ["demo", "--config", "{listed}"],
])
def test_tools_say_a_bad_yaml_file_in_one_line(tmp_path: Path, args: list[str]) -> None:
    """A probes, expectations or config file that is not valid YAML (or not a mapping):
    one line naming the file and where, exit 2, never a traceback."""
    files = {"bad": tmp_path / "bad.yaml", "listed": tmp_path / "list.yaml",
             "conv": tmp_path / "conv.json", "out": tmp_path / "rep"}
    files["bad"].write_text("- [\n")
    files["listed"].write_text("- 1\n")
    files["conv"].write_text('{"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}')
    res = memgate(*(a.format(**files) for a in args))
    out = (res.stdout + res.stderr).strip()
    assert res.returncode == 2 and "Traceback" not in out, out[-800:]
    assert len(out.splitlines()) == 1 and "yaml" in out, out
