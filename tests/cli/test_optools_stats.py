"""`memgate stats` on the log lines a real gateway writes, as log pipelines deliver them.

`docker compose logs` puts `gateway-a-1  | ` before every line, `kubectl logs
--timestamps` an RFC 3339 timestamp; console values with spaces or quotes are
JSON strings; startup, reload and error lines are no requests.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from hypothesis import given
from hypothesis import strategies as st

from gateway.cli import stats
from gateway.cli.stats import parse_console
from gateway.config.rules import load_rules
from gateway.observe.logging import ConsoleRenderer
from tests.cli.test_optools_captures import cli
from tests.conftest import SECRET, GatewayFactory, Upstream, sample

PREFIXES = {"plain": "", "docker": "gateway-a-1  | ",
            "kubectl": "2026-12-01T17:00:00.123456789Z ",
            "both": "gateway-a-1  | 2026-12-01T17:00:00.123456789Z "}
RULES = load_rules(Path(__file__).resolve().parents[2] / "rules" / "gateway.yaml", {})
ODD_MODEL = 'my "custom" model = v2'  # a client's value: spaces, quotes, an '='


async def real_log(gateway: GatewayFactory, fmt: str) -> tuple[str, list[dict[str, Any]]]:
    """Three requests in two sessions (one with an odd model name) and a config reload,
    through a gateway logging in `fmt`: its whole log, and the [mem] events."""
    gw = await gateway(fmt=fmt)
    bodies = [("s1", sample("chat_long_tools")), ("s2", sample("chat_short")),
              ("s2", {**sample("chat_short"), "model": ODD_MODEL})]
    async with aiohttp.ClientSession() as s:
        for sid, body in bodies:
            async with s.post(f"{gw.url}/v1/chat/completions", data=orjson.dumps(body),
                              headers={"Authorization": f"Bearer {SECRET}",
                                       "X-Session-Id": sid}) as r:
                assert r.status == 200
    gw.config.write_text(gw.config.read_text().replace("max_turns: 20", "max_turns: 19"))
    deadline = time.monotonic() + 5
    while "config_reload" not in gw.log.getvalue() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    text = gw.log.getvalue()
    assert "config_reload" in text
    if fmt == "json":
        events = [e for e in map(json.loads, text.splitlines()) if e.get("event") == "mem"]
    else:
        events = [parse_console(ln) for ln in text.splitlines() if ln.startswith("[mem] ")]
    assert len(events) == 3
    return text, events  # type: ignore[return-value]


async def test_stats_reads_pipeline_prefixed_console_and_json_logs(
    gateway: GatewayFactory, upstream: Upstream, tmp_path: Path
) -> None:
    """Console and JSON logs, plain or behind docker / kubectl prefixes: every [mem] line is
    a request with the gateway's own numbers, the reload line is no skipped request, a
    quoted value reads back as the client sent it."""
    for fmt in ("console", "json"):
        text, events = await real_log(gateway, fmt)
        lines = [ln for ln in text.splitlines() if ln.strip()]
        odd = [e for e in events if e["model"] == ODD_MODEL]
        assert len(odd) == 1, events  # the quoted model, quotes and '=' included
        for name, prefix in PREFIXES.items():
            log = tmp_path / f"{fmt}-{name}.log"
            log.write_text("".join(prefix + ln + "\n" for ln in lines))
            if name == "both":  # the command once per format, the rest in-process (time)
                code, out, err = await cli("stats", str(log), "--json")
                assert code == 0, err
                s = json.loads(out)
            else:
                s = stats.summary(stats.measure([str(log)], RULES, simulate=False))
            assert s["requests"] == 3 and s["skipped"] == 0, (fmt, name, s)
            assert s["sources"] == {"payloads": 0, "mem_lines": 3,
                                    "other_log_lines": len(lines) - 3}
            assert s["tokens"]["total"] == sum(int(e["est_tokens"]) for e in events)
            assert s["sessions"]["count"] == 2


RENDERED = st.one_of(st.text(max_size=40), st.integers(), st.booleans(), st.none(),
                     st.floats(allow_nan=False, allow_infinity=False, width=32))


@given(st.dictionaries(st.from_regex(r"[a-z_]{1,12}", fullmatch=True), RENDERED, max_size=8))
def test_console_values_read_back_as_written(fields: dict[str, Any]) -> None:
    """Whatever the renderer writes, the parser reads back: strings exactly (spaces, quotes,
    '=', control characters, non-ASCII), other values as the renderer spelled them."""
    fields.pop("event", None)
    fields.pop("level", None)
    line = ConsoleRenderer()(None, "", {"event": "mem", "session": "s", **fields})
    got = parse_console("web-1  | " + line)
    assert got is not None
    for k, v in fields.items():
        want = v if isinstance(v, str) else (
            "-" if v is None else "true" if v is True else "false" if v is False
            else f"{v:.2f}" if isinstance(v, float) else str(v))
        assert got[k] == want, (line, k)


def test_other_lines_are_not_mem_lines() -> None:
    """A line that only mentions [mem] inside a value, or after k=v text, is no record."""
    assert parse_console('info reload reason="see [mem] lines" x=1') is None
    assert parse_console('info x=1 [mem] session=s hist_msgs=1') is None
    assert parse_console('{"event": "x", "msg": "[mem] session=s"}') is None
    assert parse_console("2026-12-01T17:00:00Z [mem] session=s") == {"session": "s"}


async def test_plot_is_drawn_with_its_markers(tmp_path: Path) -> None:
    """--plot writes a PNG (log axis too); without samples it says why, exit code 1 (as
    `stats` measuring nothing: the command ran and failed)."""
    png = tmp_path / "tokens.png"
    code, out, err = await cli("stats", "samples/chat_long_tools.json", "--config",
                               "rules/gateway.yaml", "--plot", str(png), "--log")
    assert code == 0, err
    report = stats.measure(["samples"], RULES, simulate=False)
    assert stats.plot(report, str(tmp_path / "linear.png"), 6000, "samples") is None
    for f in (png, tmp_path / "linear.png"):
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 20_000
    empty = tmp_path / "empty.log"
    empty.write_text("info listening host=127.0.0.1 port=8080\n")
    code, out, err = await cli("stats", str(empty), "--plot", str(tmp_path / "none.png"))
    assert code == 1 and err.count("\n") == 1 and "nothing to draw" in err
    assert "1 other log lines ignored" in out and "skipped 0" in out
