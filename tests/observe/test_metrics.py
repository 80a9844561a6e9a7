"""GET /metrics: Prometheus text with bounded labels, counting what the [mem] lines say."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import orjson
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import SECRET, GatewayFactory, Upstream, sample


def value(text: str, name: str) -> float:
    """The value of one exact metric line `name value` (name includes its labels)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split(" ")[1])
    raise AssertionError(f"{name} not in metrics")


async def test_metrics_count_requests_drops_and_reloads(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """Requests by route/mode/status, dropped messages, pins, reloads; no session ids."""
    gw = await gateway(memory={"enable_eviction": True})
    body = orjson.dumps(sample("chat_long_tools"))
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(f"{gw.url}/v1/chat/completions", data=body,
                              headers={"Authorization": f"Bearer {SECRET}",
                                       "X-Session-Id": "secret-session-name"}) as r:
                assert r.status == 200
        gw.config.write_text(gw.config.read_text().replace("max_turns: 20", "max_turns: bad"))
        deadline = time.monotonic() + 2
        while gw.state.reloader.failed == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        async with s.get(f"{gw.url}/metrics") as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain")
            text = await r.text()
    ev = gw.mem_events()[-1]
    assert value(text, 'memgate_requests_total{mode="on",route="openai_chat",status="200"}') == 2
    dropped = value(text, 'memgate_dropped_messages_sum{route="openai_chat"}')
    assert dropped == 2 * int(ev["dropped"])
    assert value(text, "memgate_pinned_kept_total") == 2 * int(ev["pinned"])
    assert value(text, 'memgate_history_tokens_before_sum{route="openai_chat"}') == 2 * int(
        ev["est_tokens"])
    assert value(text, 'memgate_config_reloads_total{result="failed"}') == 1
    # the second request was the same session's history again: parsed only where it grew
    assert value(text, "memgate_history_cache_hits_total") == 1
    assert value(text, "memgate_history_cache_misses_total") == 1
    assert value(text, "memgate_history_cache_entries") == 1
    assert 0 < value(text, "memgate_history_cache_bytes") <= 256 << 20
    assert "secret-session-name" not in text and SECRET not in text


_FIELD_VALUES = (st.text(alphabet=st.sampled_from(list('ab= "\n\t\\é-_.订\r\x1b\x0b\x0c\x7f\x00'
                                                        '\x85\u2028\u2029\u202e\U0001f600')),
                         max_size=8)
                 | st.integers(-10**12, 10**12) | st.booleans() | st.none()
                 | st.floats(allow_nan=False, allow_infinity=False, width=32))


@given(fields=st.dictionaries(st.sampled_from(["session", "turn", "req", "mode", "cut", "x_y",
                                               "carried", "stream", "api"]),
                              _FIELD_VALUES, max_size=9))
def test_console_mem_line_reads_back(fields: dict[str, Any]) -> None:
    """`[mem] k=v ...`: the seed's fields first in its order, then the rest as logged; a
    value is bare unless it is empty or holds anything but printable ASCII (a space, a
    control character, U+2028, any non-ASCII) or a quote or '=', then it is an ASCII-only
    JSON string: the line is one line of printable ASCII whatever the values hold; None
    is '-', booleans true/false, floats two decimals."""
    from gateway.observe.logging import MEM_FIELDS, ConsoleRenderer

    line = ConsoleRenderer()(None, "info", {"event": "mem", "level": "info", **fields})
    assert line.startswith("[mem] ")
    assert all(" " <= c <= "~" for c in line), repr(line)
    rest, got = line[len("[mem] "):], {}
    while rest:
        key, _, rest = rest.partition("=")
        if rest.startswith('"'):
            got[key], end = json.JSONDecoder().raw_decode(rest)
            quoted = True
        else:
            end = rest.find(" ") if " " in rest else len(rest)
            got[key] = rest[:end]
            quoted = False
        rest = rest[end + 1:]
        v = fields[key]
        if isinstance(v, str):
            assert quoted == (not v or any(not "!" <= c <= "~" or c in '"=' for c in v))
    want_order = [k for k in MEM_FIELDS if k in fields] + [k for k in fields
                                                           if k not in MEM_FIELDS]
    assert list(got) == want_order

    def shown(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, float):
            return f"{v:.2f}"
        return str(v)

    assert got == {k: shown(v) for k, v in fields.items()}
