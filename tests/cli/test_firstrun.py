"""A first run with no surprises: user errors are one line and a documented exit code,
the shipped rules are found from anywhere, check-config prints a loadable config, and
the console log, the relayed routes and the [mem] counts say what happened."""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import AsyncOpenAI

from gateway.cli.main import build_parser
from gateway.config.effective import effective_config, window
from gateway.config.rules import build_rules, load_rules
from gateway.errors import RulesError
from gateway.observe import logging as mglog
from gateway.observe.metrics import route_class
from tests.conftest import ROOT, SECRET, GatewayFactory, Upstream

SHIPPED = ROOT / "rules"


def memgate(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`python -m gateway ARGS` as a user runs it (the checkout importable, nothing else)."""
    the_env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "gateway", *args], cwd=cwd or ROOT,
                          env=the_env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """`memgate ARGS` in this process (as fast as a function call), shaped like run()'s
    result; an argparse error's SystemExit is its exit code."""
    from gateway.cli.main import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


def one_line_error(res: subprocess.CompletedProcess[str], code: int) -> str:
    """The stderr of a refused command: no traceback, one line, the expected exit code."""
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == code, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    return lines[0]


# --------------------------------------------------------------------------- CLI errors


@pytest.mark.slow
def test_a_missing_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """A file the user named that is not there: what and where, exit 2, no traceback."""
    line = one_line_error(memgate("evict", "nope.json", cwd=tmp_path), 2)
    assert line == "memgate evict: nope.json: No such file or directory"


@pytest.mark.parametrize(("args", "where"), [
    (("stats", "nope/"), "memgate stats: nope: No such file or directory"),
    (("replay", "expect", "nope.jsonl", "nope.yaml"), "memgate replay expect: "),
    (("demo", "--samples", "nope"), "memgate demo: --samples nope: not a directory"),
])
def test_other_missing_files_are_one_line_and_exit_2(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        args: tuple[str, ...], where: str) -> None:
    """The same for the other commands that read files (in this process: faster)."""
    monkeypatch.chdir(tmp_path)
    line = one_line_error(run_main(capsys, *args), 2)
    assert line.startswith(where) and "nope" in line, line


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_port_in_use_is_one_line_and_exit_1(workers: str) -> None:
    """serve on a port another socket holds: the address and why, exit 1 (the same with
    several workers, whose parent reserves the port first)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        res = memgate("serve", "--port", str(port), "--workers", workers)
    assert "Traceback" not in res.stderr and res.returncode == 1, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last == (f"memgate serve: cannot listen on 127.0.0.1:{port}: the address is "
                    "already in use (another memgate or server on that port?)")


def test_a_host_not_of_this_machine_is_one_line_and_exit_1(
        capsys: pytest.CaptureFixture[str]) -> None:
    """--host with an address no interface has (TEST-NET-1: nothing is sent anywhere)."""
    res = run_main(capsys, "serve", "--host", "192.0.2.1", "--port", "0")
    assert res.returncode == 1, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last == ("memgate serve: cannot listen on 192.0.2.1:0: the address is not one of "
                    "this machine's"), last
    mglog.configure("console", "info")


@pytest.mark.parametrize("port", ["99999", "-1", "65536", "http"])
def test_a_port_out_of_range_is_refused_with_serve_usage(
        capsys: pytest.CaptureFixture[str], port: str) -> None:
    """--port 99999 used to bind a random port while logging 99999: now a usage error."""
    res = run_main(capsys, "serve", "--port", port)
    assert res.returncode == 2
    assert res.stderr.startswith("usage: memgate serve ")
    assert "argument --port:" in res.stderr


@pytest.mark.slow
def test_port_0_binds_any_free_port_and_logs_the_bound_one(tmp_path: Path) -> None:
    """--port 0 is documented as any free port: the `listening` line names the real one."""
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--port", "0"],
                            cwd=tmp_path, env={"PATH": os.environ.get("PATH", ""),
                                               "PYTHONPATH": str(ROOT)},
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    try:
        line = ""
        deadline = time.monotonic() + 30
        while " listening " not in line and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "serve exited before listening"
        port = int(re.search(r"port=(\d+)", line).group(1))  # type: ignore[union-attr]
        assert port != 0
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # the logged port is the one that answers
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stderr.close()


@pytest.mark.parametrize(("backend", "var"), [
    ({"state": {"backend": "redis"}}, "MEMGATE_REDIS_URL"),
    ({"store": {"backend": "postgres"}}, "MEMGATE_STORE_DSN"),
])
def test_a_backend_without_its_env_var_is_caught_by_check_config_and_serve(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        backend: dict[str, Any], var: str) -> None:
    """state.backend redis / store.backend postgres without the URL: exit 2 before serving,
    naming the key and the variable, in check-config too."""
    monkeypatch.delenv(var, raising=False)
    cfg = tmp_path / "g.yaml"
    cfg.write_text(yaml.safe_dump(backend))
    checked = one_line_error(run_main(capsys, "check-config", str(cfg)), 2)
    key = next(iter(backend)) + ".backend"
    assert checked.startswith(f"{cfg}: {key}: ") and f"${var}" in checked
    served = one_line_error(run_main(capsys, "serve", "--config", str(cfg), "--port", "0"), 2)
    assert served.startswith(f"memgate serve: invalid config: {cfg}: {key}: ")
    monkeypatch.setenv(var, "redis://127.0.0.1:1/0" if "REDIS" in var else "postgresql://x@h/d")
    ok = run_main(capsys, "check-config", str(cfg))
    assert ok.returncode == 0, ok.stderr


@pytest.mark.slow
def test_version_and_a_wrong_flag_shows_that_commands_usage(
        capsys: pytest.CaptureFixture[str]) -> None:
    """--version prints the version; a wrong flag after a subcommand shows its own usage."""
    res = memgate("--version")
    assert res.returncode == 0 and re.fullmatch(r"memgate \d+\.\d+\.\d+\n", res.stdout)
    for args, usage in ((("evict", "x.json", "--bogus"), "usage: memgate evict "),
                        (("stats", "--bogus", "x"), "usage: memgate stats "),
                        (("replay", "ab", "c.json", "--probes", "p", "--upstream", "u",
                          "--bogus"), "usage: memgate replay ab "),
                        (("memory", "get", "id1", "--bogus"), "usage: memgate memory get ")):
        res = run_main(capsys, *args)
        assert res.returncode == 2 and res.stderr.startswith(usage), (args, res.stderr)
        assert "unrecognized arguments: --bogus" in res.stderr


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    out = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                out += _parsers(child)
    return out


def test_every_flag_has_help_and_the_description_lists_every_subcommand() -> None:
    """Each option and positional of each (sub)command says what it is for; the top-level
    description names every subcommand; the epilog documents the exit codes."""
    top = build_parser()
    missing = [f"{p.prog}: {'/'.join(a.option_strings) or a.dest}"
               for p in _parsers(top) for a in p._actions
               if not isinstance(a, argparse._SubParsersAction) and not a.help]
    assert not missing, missing
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    assert top.description is not None
    for name in sub.choices:
        assert re.search(rf"^  {re.escape(name)} ", top.description, re.M), name
    assert top.epilog is not None and "0 ok" in top.epilog and "2 usage" in top.epilog


# --------------------------------------------------------------------------- config files


@pytest.mark.slow
def test_a_copied_config_falls_back_to_the_shipped_files(tmp_path: Path) -> None:
    """The shipped gateway.yaml copied alone to another folder loads with the shipped model
    map and carry patterns; a models.yaml beside it wins; a models_file that is named but
    absent is refused with the key and the resolved path."""
    cfg = tmp_path / "gateway.yaml"
    shutil.copy(SHIPPED / "gateway.yaml", cfg)
    rules = load_rules(cfg, {})
    assert rules.models_path == str((SHIPPED / "models.yaml").resolve())
    assert rules.carry_path == str((SHIPPED / "carry.yaml").resolve())
    assert any(m.match == "gpt-4o*" for m in rules.models)
    (tmp_path / "models.yaml").write_text(
        "models:\n  - {match: 'mine-*', encoding: cl100k_base, context_window: 1000}\n")
    beside = load_rules(cfg, {})
    assert beside.models_path == str(tmp_path / "models.yaml")
    assert [m.match for m in beside.models] == ["mine-*"]
    text = cfg.read_text().replace("  # models_file: models.yaml",
                                   "  models_file: ../elsewhere/models.yaml #")
    cfg.write_text(text)
    with pytest.raises(RulesError) as exc:
        load_rules(cfg, {})
    assert exc.value.key == "tokens.models_file"
    assert str((tmp_path.parent / "elsewhere" / "models.yaml").resolve()) in exc.value.reason
    line = one_line_error(memgate("check-config", str(cfg), cwd=tmp_path), 2)
    assert line.startswith(f"{cfg}:{exc.value.line}: tokens.models_file: ")


def test_the_printed_effective_config_is_itself_a_valid_config(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """check-config's stdout saved as a file checks again to the same output and loads to
    the same rules (the env override included)."""
    env = {"MEMGATE_ENABLE_EVICTION": "1"}
    monkeypatch.setenv("MEMGATE_ENABLE_EVICTION", "1")
    first = run_main(capsys, "check-config", str(SHIPPED / "gateway.yaml"))
    assert first.returncode == 0, first.stderr
    saved = tmp_path / "effective.yaml"
    saved.write_text(first.stdout)
    again = run_main(capsys, "check-config", str(saved))
    assert again.returncode == 0, again.stderr
    body = [ln for ln in first.stdout.splitlines() if not ln.startswith("#")]
    assert [ln for ln in again.stdout.splitlines() if not ln.startswith("#")] == body
    a, b = load_rules(SHIPPED / "gateway.yaml", env), load_rules(saved, env)
    assert a == replace(b, source=a.source)


_VALUES = st.fixed_dictionaries({}, optional={
    "max_tokens": st.one_of(st.none(), st.just("auto"), st.integers(1, 10**6)),
    "max_chars": st.one_of(st.none(), st.integers(1, 10**7)),
    "order": st.sampled_from([["pinned", "length"], ["recent_turns"],
                              ["pinned", "recent_turns", "compact_tools", "length", "score"]]),
    "low_water": st.floats(0.1, 1.0),
    "exclude_tools": st.lists(st.text("abc_", min_size=1, max_size=5), max_size=3),
    "window": st.integers(0, 10**7).map(lambda n: f"{n}{'smhd'[n % 4]}"),
    "tags": st.lists(st.sampled_from(["a", "b-c", "x_1"]), max_size=3, unique=True),
    "port": st.integers(0, 65535),
    "anonymous": st.one_of(st.none(), st.just("guests")),
    "carry": st.booleans(),
    "archive": st.sampled_from(["off", "evicted", "all"]),
    "proxy": st.one_of(st.none(), st.just("http://proxy.local:3128")),
})


def _config(v: dict[str, Any]) -> dict[str, Any]:
    memory: dict[str, Any] = {
        "budget": {k: v[k] for k in ("max_tokens", "max_chars") if k in v},
        "eviction": {**({"order": v["order"]} if "order" in v else {}),
                     **({"low_water": v["low_water"]} if "low_water" in v else {}),
                     "compact": {"exclude_tools": v.get("exclude_tools", [])}},
    }
    if v.get("carry"):
        memory["carry"] = {"enabled": True, "ref_ttl_turns": 5}
    store: dict[str, Any] = {"archive": v.get("archive", "off"),
                             "default_tags": v.get("tags", [])}
    if "window" in v:
        store["default_time_window"] = v["window"]
    upstream = {"name": "openai", "base_url": "https://api.openai.com"}
    if v.get("proxy"):
        upstream["proxy"] = v["proxy"]
    return {"memory": memory, "store": store, "upstreams": [upstream],
            "listen": {"port": v.get("port", 8080)},
            "tenants": {"anonymous": v.get("anonymous")}}


@settings(max_examples=25)
@given(_VALUES)
def test_effective_config_loads_back_to_the_same_rules(values: dict[str, Any]) -> None:
    """Property: for any valid config, effective_config(rules), dumped as YAML and loaded,
    is the same Rules (checked once against a planted bug: a dropped `proxy` key)."""
    rules = build_rules(_config(values), "<a>", base_dir=SHIPPED)
    text = yaml.safe_dump(effective_config(rules), sort_keys=False)
    back = build_rules(yaml.safe_load(text), "<a>", base_dir=Path("/nonexistent"))
    assert back == rules


def test_window_spells_seconds_as_the_loader_reads_them() -> None:
    """7 days print as 7d, 90 minutes as 90m, 0 as 0d."""
    assert (window(7 * 86400), window(5400), window(61), window(0)) == ("7d", "90m", "61s",
                                                                       "0d")


# --------------------------------------------------------------------------- logs, routes


def test_console_lines_carry_a_utc_millisecond_timestamp() -> None:
    """Every console line has a timestamp: first on other lines, the last field of [mem]
    (so `^[mem] ` still finds request lines, the seed's fields first); JSON has
    `timestamp`."""
    out = io.StringIO()
    mglog.configure("console", "info", stream=out)
    log = mglog.get_logger()
    log.info("listening", host="127.0.0.1", port=8080)
    log.info("mem", session="s1", kept=3)
    ts = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
    plain, mem = out.getvalue().splitlines()
    assert re.fullmatch(rf"{ts} info listening host=127\.0\.0\.1 port=8080", plain), plain
    assert re.fullmatch(rf"\[mem\] session=s1 kept=3 ts={ts}", mem), mem
    stamped = time.strptime(plain[:19], "%Y-%m-%dT%H:%M:%S")
    assert abs(time.mktime(stamped) - time.mktime(time.gmtime())) < 120
    out = io.StringIO()
    mglog.configure("json", "info", stream=out)
    mglog.get_logger().info("listening", port=1)
    assert re.fullmatch(ts.replace(r"\.\d{3}", r"\.\d{6}"),
                        orjson.loads(out.getvalue())["timestamp"])
    mglog.configure("console", "info")


@pytest.mark.parametrize(("path", "cls"), [
    ("/v1/models", "models"), ("/v1/models/gpt-4o", "models"), ("/v1/embeddings", "embeddings"),
    ("/openai/deployments/my-dep/embeddings", "embeddings"), ("/openai/v1/files/f1", "files"),
    ("/v1/messages/count_tokens", "messages"), ("/v1/unknown-thing", "other"), ("/", "other"),
    ("/favicon.ico", "other"), ("/v1/" + "x" * 500, "other"),
])
def test_route_class_is_a_bounded_label(path: str, cls: str) -> None:
    """A relayed path's metric label is its API resource or `other`, never the path."""
    assert route_class(path) == cls


async def test_relayed_routes_get_a_log_line_and_a_metric(
        gateway: GatewayFactory, upstream: Upstream) -> None:
    """/v1/models through the real openai SDK: a `relay` line (route class, status, no key)
    and memgate_relayed_total{route_class="models",status="200"}."""
    gw = await gateway()
    client = AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET, max_retries=0)
    models = await client.models.list()
    assert [m.id for m in models.data] == ["gpt-4o-mini"]
    await client.close()
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{gw.url}/v1/nothing-here/{'x' * 40}") as r:
            assert r.status == 404
        async with s.get(f"{gw.url}/metrics") as r:
            text = await r.text()
    assert 'memgate_relayed_total{route_class="models",status="200"} 1.0' in text
    assert 'memgate_relayed_total{route_class="other",status="404"} 1.0' in text
    relays = [ln for ln in gw.log.getvalue().splitlines() if " info relay " in ln]
    assert len(relays) == 2, gw.log.getvalue()
    assert "method=GET route=models path=/v1/models status=200" in relays[0]
    assert SECRET not in gw.log.getvalue()


def _session(n: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for i in range(n):
        msgs.append({"role": "user", "content": f"question {i}: " + "lorem ipsum " * 40})
        msgs.append({"role": "assistant", "content": f"answer {i}: " + "dolor sit " * 40})
    msgs.append({"role": "user", "content": "and now?"})
    return msgs


@pytest.mark.parametrize("history_cache_mb", [0, 256])
async def test_archived_counts_what_this_request_queued(
        gateway: GatewayFactory, upstream: Upstream, tmp_path: Path,
        history_cache_mb: int) -> None:
    """A growing session past the cut: archived= is the turns newly queued by each request
    (their sum is the turns dropped, each once), with and without the history cache, which
    used to repeat the same count on every request."""
    gw = await gateway(
        {"enable_eviction": True, "eviction": {"recall_share": 0.0},
         "budget": {"max_tokens": 1500, "max_chars": None, "max_messages": None,
                    "max_turns": None}},
        session={"history_cache_mb": history_cache_mb},
        store={"archive": "evicted", "path": str(tmp_path / "m.db")})
    async with aiohttp.ClientSession() as s:
        for n in range(4, 16):
            async with s.post(f"{gw.url}/v1/chat/completions",
                              json={"model": "gpt-4o-mini", "messages": _session(n)},
                              headers={"Authorization": f"Bearer {SECRET}",
                                       "X-Session-Id": "s1"}) as r:
                assert r.status == 200
    events = await gw.wait_mem(12)
    archived = [int(e.get("archived", 0)) for e in events]
    dropped_turns = int(events[-1]["dropped"]) // 2
    assert sum(archived) == dropped_turns > 0, archived
    assert archived.count(0) > len(archived) // 2, archived  # most requests add nothing


async def test_kept_plus_note_is_the_forwarded_message_count(
        gateway: GatewayFactory, upstream: Upstream) -> None:
    """With a carry note injected, [mem] says note=1 and kept + note = the messages the
    upstream received; without one there is no note field and kept = forwarded."""
    from tests.policy.test_carry import long_session

    budget = {"max_tokens": 1500, "max_chars": None, "max_messages": None, "max_turns": None}
    for enabled in (True, False):
        gw = await gateway({"enable_eviction": True, "budget": budget,
                            "carry": {"enabled": enabled,
                                      "rules_file": str(SHIPPED / "carry.yaml")}})
        async with aiohttp.ClientSession() as s, s.post(
                f"{gw.url}/v1/chat/completions",
                json={"model": "gpt-4o-mini", "messages": long_session()},
                headers={"Authorization": f"Bearer {SECRET}", "X-Session-Id": "s-n"}) as r:
            assert r.status == 200
        (ev,) = await gw.wait_mem(1)
        forwarded = len(upstream.last_body()["messages"])
        assert int(ev["dropped"]) > 0
        assert ("note" in ev) is enabled
        assert int(ev["kept"]) + int(ev.get("note", 0)) == forwarded
