"""`memgate replay ab`: the same long conversation, A without eviction, B with a policy.

For each probe question (an early constraint, a mid-conversation conclusion,
the latest follow-up, ...) the conversation plus the question is sent twice to
the same upstream with identical parameters: A as the client wrote it (the
gateway's kill switch off), B as the policy would forward it. Automatic checks
per probe: pinned facts still in B's request, tool calls complete in B's
request, the expected fact restated in each answer, answer length/structure
drift from A to B, and B's stability over --repeat runs. Writes a Markdown and
a self-contained HTML report; exits 1 when a check fails.
"""

from __future__ import annotations

import asyncio
import difflib
import html
import re
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from gateway.config.schema import Rules
from gateway.config.yamlfile import yaml_error_line
from gateway.decide.chat import decide
from gateway.measure.conversation import first_text, is_active
from gateway.measure.tokens import Tokenizers
from gateway.observe.capture import SIDE_MEANS, describe_side, is_capture, unwrap


@dataclass(frozen=True, slots=True)
class Probe:
    id: str
    kind: str
    question: str
    expect_contains: tuple[str, ...] = ()


@dataclass(slots=True)
class ProbeResult:
    probe: Probe
    answers_a: list[str] = field(default_factory=list)
    answers_b: list[str] = field(default_factory=list)
    checks: dict[str, tuple[bool, str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(ok for ok, _ in self.checks.values())


def load_probes(path: Path) -> list[Probe]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: invalid YAML: {yaml_error_line(exc)}") from None
    items = data.get("probes") if isinstance(data, dict) else data
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: expected a list of probes (or probes: [...])")
    out = []
    for i, p in enumerate(items):
        if not isinstance(p, dict) or not isinstance(p.get("question"), str):
            raise ValueError(f"{path}: probe {i} needs a question")
        expect = p.get("expect_contains") or []
        out.append(Probe(id=str(p.get("id", f"p{i + 1}")), kind=str(p.get("kind", "probe")),
                         question=p["question"],
                         expect_contains=tuple([expect] if isinstance(expect, str) else expect)))
    return out


def _structure(text: str) -> tuple[bool, bool, bool]:
    return (bool(re.search(r"^\s*[-*] ", text, re.M)), bool(re.search(r"^\s*#", text, re.M)),
            "```" in text)


def _tool_pairs_complete(messages: list[dict[str, Any]]) -> bool:
    calls = {c.get("id") for m in messages for c in m.get("tool_calls") or []}
    results = {m.get("tool_call_id") for m in messages if m.get("role") == "tool"}
    return calls == results


@dataclass(slots=True)
class Meta:
    """What a reader of the report needs to trust it: where, which model, which policy."""

    conversation: str
    upstream: str
    model: str
    config: str
    repeat: int
    concurrency: int
    side: str | None = None  # a capture file: the side replayed
    as_configured: bool = False
    budget_tokens: int | None = None
    dropped: list[tuple[str, int, int, int]] = field(default_factory=list)  # probe, msgs, A, B

    def lines(self) -> list[tuple[str, str]]:
        rows = [("conversation", self.conversation + (
                    f" (a capture: `{self.side}`, {SIDE_MEANS[self.side]})" if self.side else "")),
                ("upstream", self.upstream), ("model", self.model or "-"),
                ("config (B's policy)", (self.config or "built-in defaults") + (
                    " as configured (kill switch included)" if self.as_configured
                    else ", eviction on")),
                ("budget_tokens", str(self.budget_tokens)),
                ("runs", f"{self.repeat} per probe and side, {self.concurrency} at a time, "
                         "temperature 0, seed 7")]
        for probe, msgs, a, b in self.dropped:
            saved = a - b
            rows.append((f"B for {probe}", f"dropped {msgs} messages, est_tokens {a} -> {b} "
                                           f"(saved {saved}, {saved / max(1, a):.0%})"))
        return rows


def chat_url(upstream: str) -> str:
    """The chat completions URL under `upstream`, its query (an api-version, say) kept."""
    from yarl import URL

    u = URL(upstream)
    return str(u.with_path(u.path.rstrip("/") + "/v1/chat/completions").with_query(u.query))


def shown_url(url: str) -> str:
    """The upstream as the report shows it: no user:password, no query (a key may sit there)."""
    from yarl import URL

    try:
        u = URL(url)
        return str(u.with_user(None).with_password(None).with_query(None).with_fragment(None))
    except (ValueError, TypeError):
        return "(unparseable URL)"


async def _ask(http: aiohttp.ClientSession, url: str, body: bytes, key: str) -> str:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    async with http.post(url, data=body, headers=headers) as r:
        data = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"upstream answered {r.status}: {str(data)[:200]}")
        return str(data["choices"][0]["message"]["content"] or "")


def chat_messages(conversation: Any, where: str) -> list[dict[str, Any]]:
    """The chat history to replay, or a ValueError saying why this body is not one."""
    msgs = conversation.get("messages") if isinstance(conversation, dict) else None
    if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
        raise ValueError(f"{where}: not a chat completions body (no messages list); "
                         "replay ab replays OpenAI chat conversations")
    return msgs


async def run_ab(
    conversation: dict[str, Any], probes: list[Probe], upstream: str, rules: Rules,
    repeat: int = 1, api_key: str = "", progress: Any = None, as_configured: bool = False,
    concurrency: int = 4, meta: Meta | None = None,
) -> list[ProbeResult]:
    """Every probe's A and B calls, at most `concurrency` in flight; one progress line per
    call; `meta` (when given) gets the budget and what B dropped per probe."""
    # B applies the policy even if the file has the kill switch off, unless asked to
    # forward exactly as the config stands (checking a rollback)
    on = rules if as_configured else replace(rules, memory=replace(rules.memory,
                                                                   enable_eviction=True))
    tok = Tokenizers(rules.token_cache_size)
    url = chat_url(upstream)
    params = {"temperature": 0, "seed": 7}
    history = chat_messages(conversation, "the conversation")
    gate = asyncio.Semaphore(max(1, concurrency))
    total, done = len(probes) * repeat * 2, 0

    async def call(http: aiohttp.ClientSession, probe: Probe, side: str, run: int,
                   body: bytes) -> str:
        nonlocal done
        async with gate:
            t0 = time.perf_counter()
            try:
                return await _ask(http, url, body, api_key)
            finally:
                done += 1
                if progress is not None:
                    progress.write(f"replay ab: [{done}/{total}] {probe.id} {side} run {run}: "
                                   f"{time.perf_counter() - t0:.2f} s\n")
                    progress.flush()

    results = []
    async with aiohttp.ClientSession() as http:
        calls: list[tuple[ProbeResult, Any, list[dict[str, Any]], Any]] = []
        for probe in probes:
            msgs = [*history, {"role": "user", "content": probe.question}]
            body = {**conversation, **params, "messages": msgs}
            body.pop("stream", None)
            raw = orjson.dumps(body)
            d = decide(raw, orjson.loads(raw), on, tok)
            a_body = orjson.dumps({**body, "messages": [
                {k: v for k, v in m.items() if k != "memgate"} for m in msgs]})
            res = ProbeResult(probe)
            both = asyncio.gather(
                asyncio.gather(*(call(http, probe, "A", i + 1, a_body) for i in range(repeat))),
                asyncio.gather(*(call(http, probe, "B", i + 1, d.forward)
                                 for i in range(repeat))))
            calls.append((res, d, orjson.loads(d.forward)["messages"], both))
            if meta is not None:
                meta.budget_tokens = d.budget_tokens
                dropped = len(d.plan.dropped) if d.plan is not None else 0
                kept = d.kept_tokens() if d.plan is not None else d.est_tokens()
                meta.dropped.append((probe.id, dropped, d.est_tokens(), kept))
        try:
            answers = await asyncio.gather(*(c[3] for c in calls))
        finally:
            for c in calls:
                c[3].cancel()
        for (res, d, b_msgs, _), (a_answers, b_answers) in zip(calls, answers, strict=True):
            res.answers_a, res.answers_b = list(a_answers), list(b_answers)
            _check(res, d, b_msgs)
            results.append(res)
    return results


def _check(res: ProbeResult, d: Any, b_msgs: list[dict[str, Any]]) -> None:
    conv, plan = d.conv, d.plan
    pinned = [i for g in conv.groups for i, p in g.pins
              if is_active(p, g.turn, conv.n_turns, 0.7)] if conv else []
    kept = set(plan.kept) if plan else set()
    lost = [i for i in pinned if i not in kept]
    res.checks["pinned_in_b"] = (not lost, "all pinned messages forwarded" if not lost else
                                 "pinned message(s) dropped: " + ", ".join(
                                     repr((first_text(d.messages[i].get("content")) or "")[:40])
                                     for i in lost))
    complete = _tool_pairs_complete(b_msgs)
    res.checks["tool_calls_complete_in_b"] = (complete, "every tool call has its results"
                                              if complete else "a tool call lost its results")
    for side, answers in (("a", res.answers_a), ("b", res.answers_b)):
        for want in res.probe.expect_contains:
            hit = all(want.lower() in a.lower() for a in answers)
            res.checks[f"{side}_restates:{want}"] = (hit, "restated" if hit else "missing")
    a, b = res.answers_a[0], res.answers_b[0]
    ratio = len(b) / max(1, len(a))
    res.checks["length_b_vs_a"] = (0.5 <= ratio <= 2.0, f"B/A length ratio {ratio:.2f}")
    same_shape = _structure(a) == _structure(b)
    res.checks["structure_b_vs_a"] = (same_shape, "same structure" if same_shape else
                                      "lists/headings/code blocks differ")
    stable = len(set(res.answers_b)) == 1
    res.checks["b_stable_over_repeats"] = (stable, f"{len(set(res.answers_b))} distinct B answers "
                                           f"in {len(res.answers_b)} runs")


def word_diff(a: str, b: str) -> list[tuple[str, str]]:
    """(op, text) runs turning A's answer into B's, word by word: op is `=`, `-` or `+`."""
    wa, wb = re.findall(r"\S+\s*", a), re.findall(r"\S+\s*", b)
    out: list[tuple[str, str]] = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, wa, wb, autojunk=False).get_opcodes():
        if op == "equal":
            out.append(("=", "".join(wa[i1:i2])))
            continue
        if i2 > i1:
            out.append(("-", "".join(wa[i1:i2])))
        if j2 > j1:
            out.append(("+", "".join(wb[j1:j2])))
    return out


def markdown(results: list[ProbeResult], title: str, meta: Meta | None = None) -> str:
    out = [f"# A/B replay: {title}", "",
           f"{sum(r.ok for r in results)}/{len(results)} probes pass all checks.", ""]
    if meta is not None:
        out += ["| run | |", "|---|---|"]
        out += [f"| {k} | {v.replace('|', '/')} |" for k, v in meta.lines()]
        out.append("")
    for r in results:
        out += [f"## {'PASS' if r.ok else 'FAIL'} {r.probe.id} ({r.probe.kind})", "",
                f"**Question:** {r.probe.question}", "", "| A (no eviction) | B (policy) |",
                "|---|---|",
                f"| {r.answers_a[0].replace('|', '/')} | {r.answers_b[0].replace('|', '/')} |", "",
                "| check | result | detail |", "|---|---|---|"]
        out += [f"| {name} | {'ok' if ok else 'FAIL'} | {detail} |"
                for name, (ok, detail) in r.checks.items()]
        diff = list(difflib.unified_diff(r.answers_a[0].split(". "), r.answers_b[0].split(". "),
                                         "A", "B", lineterm="", n=1))
        out += ["", "A -> B:" if diff else "A and B answered the same.", ""]
        if diff:
            out += ["```diff", *diff, "```"]
        out.append("")
    return "\n".join(out)


def html_report(results: list[ProbeResult], title: str, meta: Meta | None = None) -> str:
    """Self-contained HTML: the run's metadata, per probe the answers side by side, a
    word diff A -> B and the checks. Every text from a model or a file is escaped."""
    e = html.escape
    rows = []
    for r in results:
        checks = "".join(
            f"<li class={'ok' if ok else 'fail'}>{e(name)}: {e(detail)}</li>"
            for name, (ok, detail) in r.checks.items())
        diff = "".join(
            e(t) if op == "=" else f"<{'del' if op == '-' else 'ins'}>{e(t)}"
                                   f"</{'del' if op == '-' else 'ins'}>"
            for op, t in word_diff(r.answers_a[0], r.answers_b[0]))
        rows.append(
            f"<section><h2 class={'ok' if r.ok else 'fail'}>{'PASS' if r.ok else 'FAIL'} "
            f"{e(r.probe.id)} <small>{e(r.probe.kind)}</small></h2>"
            f"<p><b>Question:</b> {e(r.probe.question)}</p><table><tr><th>A (no eviction)</th>"
            f"<th>B (policy)</th></tr><tr><td>{e(r.answers_a[0])}</td>"
            f"<td>{e(r.answers_b[0])}</td></tr></table>"
            f"<p><b>A &rarr; B</b> (<del>only in A</del> <ins>only in B</ins>):</p>"
            f"<p class=diff>{diff}</p><ul>{checks}</ul></section>")
    info = "" if meta is None else (
        "<table class=meta>" + "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>"
                                       for k, v in meta.lines()) + "</table>")
    style = ("body{font-family:sans-serif;max-width:70em;margin:auto}td{vertical-align:top;"
             "border:1px solid #ccc;padding:.5em;width:50%}.ok{color:#176617}.fail{color:#b00}"
             "table.meta td{width:auto}table.meta th{text-align:left;padding-right:1em}"
             "del{background:#fdd;color:#900}ins{background:#dfd;color:#060;text-decoration:none}"
             ".diff{border:1px solid #ccc;padding:.5em;white-space:pre-wrap}")
    return (f"<!doctype html><meta charset=utf-8><title>{e(title)}</title><style>{style}</style>"
            f"<h1>A/B replay: {e(title)}</h1>"
            f"<p>{sum(r.ok for r in results)}/{len(results)} probes pass all checks.</p>"
            f"{info}{''.join(rows)}")


def load_conversation(path: Path, side: str) -> tuple[dict[str, Any], str | None]:
    """The conversation to replay and, for a capture file, the side it came from."""
    raw = path.read_bytes()
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from None
    if not is_capture(data):
        chat_messages(data, str(path))
        return data, None
    _, body, api = unwrap(raw, data, side)
    print(describe_side(str(path), side, api), file=sys.stderr)
    if api and api != "openai_chat":
        raise ValueError(f"{path}: a capture of {api}; replay ab replays OpenAI chat "
                         "conversations")
    chat_messages(body, f"{path} ({side})")
    return body, side


def main(args: Any, rules: Rules) -> int:
    side = getattr(args, "side", "before")
    conversation, captured = load_conversation(Path(args.conversation), side)
    probes = load_probes(Path(args.probes))
    concurrency = getattr(args, "concurrency", 4)
    if concurrency < 1:
        raise ValueError(f"--concurrency must be at least 1, got {concurrency}")
    meta = Meta(conversation=str(args.conversation), upstream=shown_url(args.upstream),
                model=str(conversation.get("model") or ""), config=rules.source or "",
                repeat=args.repeat, concurrency=concurrency, side=captured,
                as_configured=args.as_configured)
    results = asyncio.run(run_ab(conversation, probes, args.upstream, rules, args.repeat,
                                 args.api_key or "", sys.stderr,
                                 as_configured=args.as_configured, concurrency=concurrency,
                                 meta=meta))
    title = Path(args.conversation).name
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    key = args.api_key or ""
    for name, text in (("report.md", markdown(results, title, meta)),
                       ("report.html", html_report(results, title, meta))):
        if len(key) >= 8:  # an upstream that echoes the key must not publish it
            text = text.replace(key, "[api key redacted]").replace(
                html.escape(key), "[api key redacted]")
        (out / name).write_text(text, encoding="utf-8")
    for r in results:
        print(f"{'PASS' if r.ok else 'FAIL'} {r.probe.id} ({r.probe.kind})"
              + "".join(f"\n  FAIL {k}: {d}" for k, (ok, d) in r.checks.items() if not ok))
    print(f"reports: {out / 'report.md'}, {out / 'report.html'}")
    return 0 if all(r.ok for r in results) else 1
