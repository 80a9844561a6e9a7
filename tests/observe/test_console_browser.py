"""The console in a real browser (headless Chromium from the OS packages), offline, against
a gateway under a small scripted load from the real SDKs: its figures are the [mem] lines'."""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import anthropic
import openai
import orjson
import pytest

from tests.conftest import ROOT, SECRET, Gateway, GatewayFactory, Upstream
from tests.policy.test_carry import long_session
from tests.wire.test_wire_sdks import long_anthropic_history

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
TOKEN = "adm-" + SECRET[::-1]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
         # no name resolves: whatever the page needed from the internet would fail to load
         "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", "--virtual-time-budget=4000",
         "--window-size=1400,1000"]
# the words of the messages the load sends: none may reach a page
MESSAGE_TEXT = ("Status check", "any news", "Remind me", "Still running", "Summarise",
                "read file", "Be brief", "data assistant", "/data/orders")


class Elements(HTMLParser):
    """Every start tag's attributes, in document order."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, {k: v or "" for k, v in attrs}))


def parse(dom: str) -> list[tuple[str, dict[str, str]]]:
    p = Elements()
    p.feed(dom)
    return p.tags


async def browse(gw: Gateway, tmp: Path, name: str, then: str) -> tuple[str, Path]:
    """Sign in through the console's own form (posted by a local page) and open `then`:
    the DOM Chromium ends with, and its screenshot."""
    login = tmp / f"{name}-login.html"
    login.write_text(f'<form method="post" action="{gw.url}/admin/console/login">'
                     f'<input name="token" value="{TOKEN}"><input name="next" value="{then}">'
                     "</form><script>document.forms[0].submit()</script>", encoding="utf-8")
    shot = tmp / f"{name}.png"
    proc = await asyncio.create_subprocess_exec(
        str(CHROMIUM), *FLAGS, f"--user-data-dir={tmp / ('profile-' + name)}",
        f"--screenshot={shot}", "--dump-dom", login.as_uri(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    try:
        stdout, _ = await asyncio.wait_for(proc.communicate(), 90)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, f"chromium exited {proc.returncode}"
    assert shot.stat().st_size > 10_000
    return stdout.decode("utf-8"), shot


async def load(gw: Gateway) -> None:
    """Three sessions through the SDKs: a growing one whose history is cut and carried,
    a streamed one that fits, an Anthropic one with tool calls."""
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET,
                                  max_retries=0) as c:
        for turns in (20, 21, 22):
            await c.chat.completions.create(model="gpt-4o-mini", messages=long_session(turns),
                                            extra_headers={"X-Session-Id": "agent/orders-1"})
        for k in range(2):
            stream = await c.chat.completions.create(
                model="gpt-4o-mini", stream=True,
                messages=[{"role": "user", "content": f"Status check {k}"}],
                extra_headers={"X-Session-Id": "chat-small"})
            async for _ in stream:
                pass
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=SECRET, max_retries=0) as a:
        await a.messages.create(model="claude-3-5-haiku-20241022", max_tokens=100,
                                system="Be brief.", messages=long_anthropic_history(),
                                extra_headers={"X-Session-Id": "claude:tools"})


def nearest_rank(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def figure(tags: list[tuple[str, dict[str, str]]], key: str) -> str:
    (value,) = [a["data-value"] for _, a in tags if a.get("id") == f"fig-{key}"]
    return value


def offline_and_textless(dom: str, gw: Gateway) -> None:
    """No URL but the gateway's own, nothing loaded from anywhere, no script; no
    message text, client key or admin token."""
    for url in re.findall(r"https?://[^\s\"'<>)]+", dom):
        assert url.startswith(gw.url), url
    assert "<script" not in dom and " src=" not in dom
    for text in (*MESSAGE_TEXT, SECRET, TOKEN):
        assert text not in dom, text


@pytest.mark.skipif(not CHROMIUM.exists(), reason="/usr/bin/chromium is not installed "
                    "(Debian package chromium): the console's browser test needs it")
async def test_console_in_a_browser(gateway: GatewayFactory, upstream: Upstream,
                                    tmp_path: Path) -> None:
    """The overview's figures and each request of a session, as Chromium renders them,
    are those of the [mem] lines; the pages work offline and show no text or key."""
    carry = {"enabled": True, "rules_file": str(ROOT / "rules" / "carry.yaml")}
    gw = await gateway(memory={"enable_eviction": True, "carry": carry, "budget": {
        "max_tokens": 1500, "max_chars": None, "max_messages": None, "max_turns": None}},
        console={"enabled": True}, env={"MEMGATE_ADMIN_TOKEN": TOKEN})
    await load(gw)
    events = await gw.wait_mem(6)
    sid = "agent/orders-1"
    # the session's tenant: the hash of the load's key, as the overview's link carries it
    then = ("/admin/console/session?id=agent%2Forders-1&t=t-"
            + hashlib.sha256(SECRET.encode()).hexdigest()[:16])
    (main_dom, main_png), (session_dom, session_png) = await asyncio.gather(
        browse(gw, tmp_path, "overview", "/admin/console"), browse(gw, tmp_path, "session", then))
    keep = os.environ.get("MEMGATE_CONSOLE_SCREENSHOTS")  # e.g. docs/console, to look at
    if keep:
        shutil.copy(main_png, Path(keep) / "overview.png")
        shutil.copy(session_png, Path(keep) / "session.png")

    tags = parse(main_dom)
    assert int(figure(tags, "requests")) == len(events) == 6
    assert int(figure(tags, "client-tokens")) == sum(int(e["est_tokens"]) for e in events)
    dropped = {a["id"][12:]: int(a["data-value"]) for _, a in tags
               if a.get("id", "").startswith("fig-dropped-")}
    assert sum(dropped.values()) == sum(int(e["dropped"]) for e in events) > 0
    assert int(figure(tags, "over-budget")) == sum(e.get("over_budget") == "true"
                                                   for e in events)
    assert int(figure(tags, "fallback")) == sum("fallback" in e for e in events) == 0
    overheads = [float(e["overhead_ms"]) for e in events]
    assert float(figure(tags, "overhead-p50")) == pytest.approx(nearest_rank(overheads, 0.5))
    assert float(figure(tags, "overhead-p99")) == pytest.approx(nearest_rank(overheads, 0.99))
    # the provider's own counts, as the mock upstream reports them on every answer
    assert int(figure(tags, "usage-in")) == sum(int(e.get("usage_in", 0)) for e in events) > 0
    assert int(figure(tags, "usage-out")) == sum(int(e.get("usage_out", 0)) for e in events) > 0
    assert int(figure(tags, "usage-cached")) == sum(int(e.get("usage_cached", 0))
                                                    for e in events)
    mode = [a["data-value"] for _, a in tags if a.get("id") == "mode"]
    assert mode == ["on"]
    rows = [a["data-session"] for _, a in tags if a.get("class") == "session-row"]
    last = {e["session"]: e for e in events}
    assert set(rows) == set(last)
    # largest history first
    assert rows == sorted(rows, key=lambda s: -int(last[s]["est_tokens"]))
    offline_and_textless(main_dom, gw)

    tags = parse(session_dom)
    mine = [e for e in events if e["session"] == sid]
    blocks: list[dict[str, Any]] = []
    for tag, a in tags:
        if a.get("class") == "req":
            blocks.append({"req": a["data-req"], "fields": {}, "strip": []})
        elif blocks and "data-field" in a:
            blocks[-1]["fields"][a["data-field"]] = a["data-value"]
        elif blocks and tag == "rect" and "data-kind" in a:
            blocks[-1]["strip"].append((a["data-kind"], int(a["data-count"])))
    assert [b["req"] for b in blocks] == [e["req"] for e in reversed(mine)]
    notes = [orjson.loads(r["raw"])["messages"][-2] for r in upstream.received
             if r["headers"].get("X-Session-Id") == sid]
    assert [n["role"] for n in notes] == ["system"] * 3  # each cut request carried a note
    for b, e, sent in zip(blocks, reversed(mine), reversed(notes)):
        f = b["fields"]
        for k in ("kept", "dropped", "pinned", "est_tokens", "prefix_tokens", "carried"):
            assert f[k] == e[k], k
        assert f["cut"] == e["cut"]
        assert sum(n for _, n in b["strip"]) == int(e["hist_msgs"])
        assert sum(n for kind, n in b["strip"] if kind.startswith("drop:")) == int(e["dropped"])
        assert int(f["note_chars"]) == len(sent["content"])
    offline_and_textless(session_dom, gw)
