"""`memgate replay ab`: the report says what was run, diffs A and B, calls run bounded."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from gateway.cli.replay import chat_url, load_probes, shown_url, word_diff
from gateway.config.rules import load_rules
from gateway.decide.chat import decide
from gateway.measure.tokens import Tokenizers
from tests.cli.test_optools_captures import cli

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-replay-SECRET-0123456789abcdef"


async def test_report_metadata_diff_concurrency_and_no_key(aiohttp_server: Any,
                                                           tmp_path: Path) -> None:
    """An upstream that echoes the caller's Authorization in its answer and counts calls in
    flight: at most --concurrency at once (and more than one), one progress line per call,
    the report names upstream, model, config, budget and what B dropped and saved, diffs
    A against B (escaped), and never shows the key."""
    state = {"now": 0, "max": 0, "calls": 0}

    async def chat(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        state["now"] += 1
        state["calls"] += 1
        state["max"] = max(state["max"], state["now"])
        await asyncio.sleep(0.05)
        state["now"] -= 1
        text = (f"<b>{len(body['messages'])} messages</b> key={request.headers['Authorization']}"
                f" q={body['messages'][-1]['content'][:20]}")
        return web.json_response({"id": "c", "object": "chat.completion", "created": 0,
                                  "model": body["model"], "choices": [{
                                      "index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": text}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    out = tmp_path / "r"
    code, stdout, err = await cli(
        "replay", "ab", "samples/chat_long_tools.json", "--probes",
        "samples/probes_long_tools.yaml", "--upstream", url,
        "--config", "rules/gateway.yaml", "--repeat", "2", "--concurrency", "3",
        "--api-key", KEY, "--out", str(out))
    probes = load_probes(ROOT / "samples" / "probes_long_tools.yaml")
    calls = len(probes) * 2 * 2
    assert state["calls"] == calls and 1 < state["max"] <= 3, state
    progress = [ln for ln in err.splitlines() if ln.startswith("replay ab: [")]
    assert len(progress) == calls and progress[-1].startswith(f"replay ab: [{calls}/{calls}]")
    html = (out / "report.html").read_text()
    md = (out / "report.md").read_text()
    for text in (html, md, stdout, err):
        assert KEY not in text
    assert "[api key redacted]" in html  # the echoed key, replaced
    assert "&lt;b&gt;" in html and "<b>155" not in html  # the answer is escaped
    assert f"<td>{url}</td>" in html and "<td>gpt-4o-mini</td>" in html
    assert "rules/gateway.yaml" in html

    rules = load_rules(ROOT / "rules" / "gateway.yaml", {"MEMGATE_ENABLE_EVICTION": "1"})
    conv = orjson.loads((ROOT / "samples" / "chat_long_tools.json").read_bytes())
    for p in probes:
        body = {**conv, "temperature": 0, "seed": 7,
                "messages": [*conv["messages"], {"role": "user", "content": p.question}]}
        raw = orjson.dumps(body)
        d = decide(raw, orjson.loads(raw), rules, Tokenizers(1000))
        a, b = d.est_tokens(), d.kept_tokens()
        assert (f"B for {p.id}</th><td>dropped {len(d.plan.dropped)} messages, est_tokens "
                f"{a} -&gt; {b} (saved {a - b}, {(a - b) / a:.0%})") in html
        assert f"<th>budget_tokens</th><td>{d.budget_tokens}</td>" in html
    # the diff: A saw more messages than B, and says so in <del>/<ins>
    assert re.search(r"<del>&lt;b&gt;\d+ </del><ins>&lt;b&gt;\d+ </ins>", html), html[-3000:]
    assert "```diff" in md


def test_word_diff_rebuilds_both_sides() -> None:
    """The diff runs spell A (= and -) and B (= and +) exactly."""
    a, b = "the report is report_0421.csv with a BOM", "the report is out.csv with a BOM."
    runs = word_diff(a, b)
    assert "".join(t for op, t in runs if op != "+") == a
    assert "".join(t for op, t in runs if op != "-") == b
    assert ("-", "report_0421.csv ") in runs and ("+", "out.csv ") in runs


def test_report_shows_no_credentials_of_the_upstream_url() -> None:
    """user:password and a query (where a key may sit) never reach the report."""
    assert chat_url("https://h.example/openai/?api-version=1") == (
        "https://h.example/openai/v1/chat/completions?api-version=1")
    assert chat_url("http://127.0.0.1:8080") == "http://127.0.0.1:8080/v1/chat/completions"
    shown = shown_url("https://user:pw-SECRET@api.example.com/v1?api_key=k-SECRET#x")
    assert shown == "https://api.example.com/v1" and "SECRET" not in shown
