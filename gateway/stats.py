"""`memgate stats`: measure saved payloads and [mem] logs before changing behaviour.

Inputs: JSON payload files, JSONL (payloads or JSON [mem] log lines), console
[mem] log lines, directories of those, or `-` for stdin. Reports the
distribution of messages / characters / estimated tokens per request, the
per-session picture (how much of the volume the longest 10% of sessions
carry) and, with `--config`, what that policy would drop.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import orjson

from .chat import decide
from .errors import GatewayError
from .rules import Rules
from .session import session_id
from .tokens import Tokenizers
from .wire import sniff

MEASURES = ("messages", "chars", "tokens")
SUFFIXES = frozenset((".json", ".jsonl", ".ndjson", ".log"))


@dataclass(slots=True)
class Sample:
    session: str
    messages: int
    chars: int
    tokens: int


@dataclass(slots=True)
class Simulation:
    evicted: int = 0
    messages_dropped: int = 0
    tokens_dropped: int = 0
    pins_kept: int = 0
    over_budget: int = 0


@dataclass(slots=True)
class Report:
    samples: list[Sample] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    simulation: Simulation | None = None
    budget_tokens: int | None = None
    spend: dict[str, Spend] = field(default_factory=dict)  # [mem] records, by session


def _mem_from_console(line: str) -> dict[str, str] | None:
    if not line.startswith("[mem] "):
        return None
    out = {}
    for part in line[6:].split(" "):
        k, _, v = part.partition("=")
        out[k] = v
    return out


def iter_records(paths: list[str], stdin: TextIO) -> Iterator[tuple[str, Any]]:
    """(where, record) for every payload or [mem] record in the inputs."""
    for p in paths:
        if p == "-":
            yield from _lines("<stdin>", stdin.read())
            continue
        path = Path(p)
        files = (
            sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in SUFFIXES)
            if path.is_dir() else [path]
        )
        for f in files:
            text = f.read_text(encoding="utf-8", errors="replace")
            if f.suffix == ".json":
                try:
                    yield str(f), orjson.loads(text)
                except orjson.JSONDecodeError:
                    yield str(f), None
            else:
                yield from _lines(str(f), text)


def _lines(where: str, text: str) -> Iterator[tuple[str, Any]]:
    for n, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line:
            continue
        console = _mem_from_console(line)
        if console is not None:
            yield f"{where}:{n}", {"event": "mem", **console}
            continue
        try:
            yield f"{where}:{n}", orjson.loads(line)
        except orjson.JSONDecodeError:
            yield f"{where}:{n}", None


def measure(
    paths: list[str], rules: Rules, simulate: bool, stdin: TextIO = sys.stdin,
    progress: TextIO | None = None,
) -> Report:
    measuring = replace(rules, memory=replace(rules.memory, enable_eviction=simulate,
                                              shadow=False))
    tokenizers = Tokenizers(rules.token_cache_size)
    report = Report(simulation=Simulation() if simulate else None)
    for n, (where, rec) in enumerate(iter_records(paths, stdin), start=1):
        if progress is not None and n % 100 == 0:
            progress.write(f"\rmemgate stats: {n} records")
            progress.flush()
        if isinstance(rec, dict) and rec.get("event") == "mem":
            try:
                got = Sample(str(rec.get("session", "?")), int(rec["hist_msgs"]),
                             int(rec["hist_chars"]), int(rec["est_tokens"]))
                add_spend(report.spend, rec)  # checks its fields before it counts
                report.samples.append(got)
            except (KeyError, ValueError):
                report.skipped.append(f"{where}: a [mem] record without hist_* fields")
            continue
        if not isinstance(rec, dict):
            report.skipped.append(f"{where}: not a JSON object")
            continue
        raw = orjson.dumps(rec)
        try:
            d = decide(raw, rec, measuring, tokenizers, sniff(rec, Path(where).name))
        except GatewayError as exc:
            report.skipped.append(f"{where}: {exc.message}")
            continue
        if d.skip_reason is not None and d.conv is None:
            report.skipped.append(f"{where}: {d.skip_reason}")
            continue
        msgs = d.messages
        first_user = next((m.get("content") for m in msgs
                           if isinstance(m, dict) and m.get("role") == "user"), "")
        system = rec.get("system") or next(
            (m.get("content") for m in msgs
             if isinstance(m, dict) and m.get("role") in ("system", "developer")), "")
        sid = session_id({}, "X-Session-Id", rec, "offline", str(system), str(first_user))
        tokens = d.est_tokens()
        report.samples.append(Sample(sid, len(msgs), d.hist_chars(), tokens))
        report.budget_tokens = d.budget_tokens
        sim, p = report.simulation, d.plan
        if sim is not None and p is not None:
            if p.dropped:
                sim.evicted += 1
                sim.messages_dropped += len(p.dropped)
                kept_tokens = d.kept_tokens()
                sim.tokens_dropped += tokens - kept_tokens
            sim.pins_kept += p.pinned
            sim.over_budget += int(p.over_budget)
    if progress is not None:
        progress.write("\r" + " " * 40 + "\r")
    return report


def percentile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    k = max(0, math.ceil(q / 100 * len(ordered)) - 1)
    return ordered[k]


def summary(report: Report) -> dict[str, Any]:
    out = _summary(report)
    if report.spend:
        out["usage"] = spend_summary(report.spend)
    return out


def _summary(report: Report) -> dict[str, Any]:
    s = report.samples
    out: dict[str, Any] = {"requests": len(s), "skipped": len(report.skipped)}
    if not s:
        return out
    for m in MEASURES:
        vals = [getattr(x, m) for x in s]
        out[m] = {"min": min(vals), "p50": percentile(vals, 50), "p90": percentile(vals, 90),
                  "p99": percentile(vals, 99), "max": max(vals), "total": sum(vals)}
    per_session: dict[str, int] = {}
    for x in s:
        per_session[x.session] = per_session.get(x.session, 0) + x.tokens
    volumes = sorted(per_session.values(), reverse=True)
    top = max(1, math.ceil(len(volumes) * 0.1))
    total = sum(volumes) or 1
    out["sessions"] = {
        "count": len(volumes),
        "top10pct_sessions": top,
        "top10pct_share_of_tokens": round(sum(volumes[:top]) / total, 4),
        "largest": volumes[0],
    }
    if report.simulation is not None:
        sim = report.simulation
        out["policy"] = {
            "budget_tokens": report.budget_tokens,
            "evicted_requests": sim.evicted,
            "messages_dropped": sim.messages_dropped,
            "tokens_dropped": sim.tokens_dropped,
            "pins_kept": sim.pins_kept,
            "over_budget": sim.over_budget,
        }
    return out


def render_table(s: dict[str, Any]) -> str:
    lines = [f"requests {s['requests']}   skipped {s['skipped']}"]
    if s["requests"]:
        lines.append(f"{'measure':<10}{'min':>9}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>10}"
                     f"{'total':>12}")
        for m in MEASURES:
            r = s[m]
            lines.append(f"{m:<10}{r['min']:>9}{r['p50']:>9}{r['p90']:>9}{r['p99']:>9}"
                         f"{r['max']:>10}{r['total']:>12}")
        ss = s["sessions"]
        lines.append(
            f"sessions {ss['count']}: the top 10% ({ss['top10pct_sessions']}) carry "
            f"{ss['top10pct_share_of_tokens']:.0%} of all tokens; largest {ss['largest']} tokens"
        )
    if "policy" in s:
        p = s["policy"]
        lines.append(
            f"policy (budget_tokens {p['budget_tokens']}): {p['evicted_requests']} requests "
            f"evicted, {p['messages_dropped']} messages / {p['tokens_dropped']} tokens dropped, "
            f"{p['pins_kept']} pins kept, {p['over_budget']} over budget"
        )
    if "usage" in s:
        lines += render_spend(s["usage"])
    return "\n".join(lines)


def plot(report: Report, path: str, budget: int | None) -> str | None:
    """Histogram of tokens per request with the budget line; an error text if impossible."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("--plot needs matplotlib: pip install 'memgate[plot]' "
                "(or pip install matplotlib)")
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.hist([x.tokens for x in report.samples], bins=40)
    if budget:
        ax.axvline(budget, color="red", linestyle="--", label=f"budget {budget}")
        ax.legend()
    ax.set_xlabel("estimated tokens per request")
    ax.set_ylabel("requests")
    fig.tight_layout()
    fig.savefig(path)
    return None


# --------------------------------------------------------------------------- provider usage
# What the [mem] lines say went to the provider, per session: the tokens sent (the
# provider's own usage_in where its answer had it, else memgate's estimate of the
# forwarded body, est_sent_tokens, or of the request, est_tokens, when nothing was
# cut) against the client's original size (est_tokens, memgate's estimate of the
# request as the client sent it), and the share of the sent tokens the provider read
# from its prompt cache (usage_cached / usage_in, over the answers that had usage).

SPEND_SESSIONS = 20  # the largest sessions listed; the total counts all


@dataclass(slots=True)
class Spend:
    requests: int = 0
    original: int = 0
    sent: int = 0
    with_usage: int = 0  # requests whose answer had the provider's usage
    usage_in: int = 0
    cached: int = 0


def _count(rec: dict[str, Any], key: str) -> int | None:
    v = rec.get(key)
    if v is None or v == "":
        return None
    return int(v)


def add_spend(spend: dict[str, Spend], rec: dict[str, Any]) -> None:
    """Count one [mem] record (JSON values or console strings) into its session's row."""
    original = int(rec["est_tokens"])
    usage_in = _count(rec, "usage_in")
    cached = _count(rec, "usage_cached") or 0
    estimate = _count(rec, "est_sent_tokens")
    row = spend.setdefault(str(rec.get("session", "?")), Spend())
    row.requests += 1
    row.original += original
    if usage_in is not None:
        row.sent += usage_in
        row.with_usage += 1
        row.usage_in += usage_in
        row.cached += cached
    else:
        row.sent += estimate if estimate is not None else original


def _spend_row(x: Spend) -> dict[str, Any]:
    return {"requests": x.requests, "original_tokens": x.original, "sent_tokens": x.sent,
            "saved_share": round(1 - x.sent / x.original, 4) if x.original else None,
            "with_usage": x.with_usage, "usage_in": x.usage_in, "usage_cached": x.cached,
            "cached_share": round(x.cached / x.usage_in, 4) if x.usage_in else None}


def spend_summary(spend: dict[str, Spend]) -> dict[str, Any]:
    total = Spend()
    for x in spend.values():
        for f in Spend.__slots__:
            setattr(total, f, getattr(total, f) + getattr(x, f))
    largest = sorted(spend.items(), key=lambda kv: (-kv[1].original, kv[0]))
    return {"sessions": [{"session": k, **_spend_row(x)} for k, x in largest[:SPEND_SESSIONS]],
            "more_sessions": max(0, len(spend) - SPEND_SESSIONS),
            "total": _spend_row(total)}


def _share(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def render_spend(u: dict[str, Any]) -> list[str]:
    lines = ["provider usage: sent = the provider's usage_in where the answer had it, else "
             "memgate's estimate; original = est_tokens",
             f"{'session':<24}{'requests':>9}{'original':>11}{'sent':>11}{'saved':>7}"
             f"{'usage':>7}{'cached':>8}"]

    def row(name: str, r: dict[str, Any]) -> str:
        return (f"{name[:23]:<24}{r['requests']:>9}{r['original_tokens']:>11}"
                f"{r['sent_tokens']:>11}{_share(r['saved_share']):>7}"
                f"{r['with_usage']:>7}{_share(r['cached_share']):>8}")

    lines += [row(r["session"], r) for r in u["sessions"]]
    if u["more_sessions"]:
        lines.append(f"... {u['more_sessions']} more sessions")
    lines.append(row("total", u["total"]))
    return lines
