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
import html
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from .chat import decide
from .conversation import first_text, is_active
from .rules import Rules
from .tokens import Tokenizers


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
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
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


async def _ask(http: aiohttp.ClientSession, url: str, body: bytes, key: str) -> str:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    async with http.post(url, data=body, headers=headers) as r:
        data = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"upstream answered {r.status}: {str(data)[:200]}")
        return str(data["choices"][0]["message"]["content"] or "")


async def run_ab(
    conversation: dict[str, Any], probes: list[Probe], upstream: str, rules: Rules,
    repeat: int = 1, api_key: str = "", progress: Any = None, as_configured: bool = False,
) -> list[ProbeResult]:
    # B applies the policy even if the file has the kill switch off, unless asked to
    # forward exactly as the config stands (checking a rollback)
    on = rules if as_configured else replace(rules, memory=replace(rules.memory,
                                                                   enable_eviction=True))
    tok = Tokenizers(rules.token_cache_size)
    url = upstream.rstrip("/") + "/v1/chat/completions"
    params = {"temperature": 0, "seed": 7}
    results = []
    async with aiohttp.ClientSession() as http:
        for n, probe in enumerate(probes, start=1):
            if progress is not None:
                progress.write(f"\rreplay ab: probe {n}/{len(probes)} ({probe.id})")
                progress.flush()
            msgs = [*conversation["messages"], {"role": "user", "content": probe.question}]
            body = {**conversation, **params, "messages": msgs}
            body.pop("stream", None)
            raw = orjson.dumps(body)
            d = decide(raw, orjson.loads(raw), on, tok)
            a_body = orjson.dumps({**body, "messages": [
                {k: v for k, v in m.items() if k != "memgate"} for m in msgs]})
            res = ProbeResult(probe)
            for _ in range(repeat):
                res.answers_a.append(await _ask(http, url, a_body, api_key))
                res.answers_b.append(await _ask(http, url, d.forward, api_key))
            b_msgs = orjson.loads(d.forward)["messages"]
            _check(res, d, b_msgs)
            results.append(res)
    if progress is not None:
        progress.write("\r" + " " * 60 + "\r")
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


def markdown(results: list[ProbeResult], title: str) -> str:
    out = [f"# A/B replay: {title}", "",
           f"{sum(r.ok for r in results)}/{len(results)} probes pass all checks.", ""]
    for r in results:
        out += [f"## {'PASS' if r.ok else 'FAIL'} {r.probe.id} ({r.probe.kind})", "",
                f"**Question:** {r.probe.question}", "", "| A (no eviction) | B (policy) |",
                "|---|---|",
                f"| {r.answers_a[0].replace('|', '/')} | {r.answers_b[0].replace('|', '/')} |", "",
                "| check | result | detail |", "|---|---|---|"]
        out += [f"| {name} | {'ok' if ok else 'FAIL'} | {detail} |"
                for name, (ok, detail) in r.checks.items()]
        out.append("")
    return "\n".join(out)


def html_report(results: list[ProbeResult], title: str) -> str:
    e = html.escape
    rows = []
    for r in results:
        checks = "".join(
            f"<li class={'ok' if ok else 'fail'}>{e(name)}: {e(detail)}</li>"
            for name, (ok, detail) in r.checks.items())
        rows.append(
            f"<section><h2 class={'ok' if r.ok else 'fail'}>{'PASS' if r.ok else 'FAIL'} "
            f"{e(r.probe.id)} <small>{e(r.probe.kind)}</small></h2>"
            f"<p><b>Question:</b> {e(r.probe.question)}</p><table><tr><th>A (no eviction)</th>"
            f"<th>B (policy)</th></tr><tr><td>{e(r.answers_a[0])}</td>"
            f"<td>{e(r.answers_b[0])}</td></tr></table><ul>{checks}</ul></section>")
    style = ("body{font-family:sans-serif;max-width:70em;margin:auto}td{vertical-align:top;"
             "border:1px solid #ccc;padding:.5em;width:50%}.ok{color:#176617}.fail{color:#b00}")
    return (f"<!doctype html><meta charset=utf-8><title>{e(title)}</title><style>{style}</style>"
            f"<h1>A/B replay: {e(title)}</h1>{''.join(rows)}")


def main(args: Any, rules: Rules) -> int:
    conversation = orjson.loads(Path(args.conversation).read_bytes())
    probes = load_probes(Path(args.probes))
    results = asyncio.run(run_ab(conversation, probes, args.upstream, rules, args.repeat,
                                 args.api_key or "", sys.stderr if sys.stderr.isatty() else None,
                                 as_configured=args.as_configured))
    title = Path(args.conversation).name
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(markdown(results, title), encoding="utf-8")
    (out / "report.html").write_text(html_report(results, title), encoding="utf-8")
    for r in results:
        print(f"{'PASS' if r.ok else 'FAIL'} {r.probe.id} ({r.probe.kind})"
              + "".join(f"\n  FAIL {k}: {d}" for k, (ok, d) in r.checks.items() if not ok))
    print(f"reports: {out / 'report.md'}, {out / 'report.html'}")
    return 0 if all(r.ok for r in results) else 1
