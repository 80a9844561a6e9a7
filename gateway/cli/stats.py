"""`memgate stats`: measure saved payloads and [mem] logs before changing behaviour.

Inputs: JSON payload files, capture files (measured on one side, `before` by
default), JSONL (payloads or JSON [mem] log lines), console [mem] log lines,
directories of those, or `-` for stdin. Log lines may carry the prefixes log
pipelines add (docker compose, kubectl --timestamps); lines that are no request
(startup, reloads, errors) are counted apart, never as skipped. Reports the
distribution of messages / characters / estimated tokens per request, the
per-session picture (how much of the volume the longest 10% of sessions
carry) and, with `--config`, what that policy would drop.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import orjson

from gateway.config.schema import Rules
from gateway.decide.chat import decide
from gateway.errors import GatewayError
from gateway.measure.tokens import Tokenizers
from gateway.memory.session_sources import first_named
from gateway.observe.capture import SIDE_MEANS, is_capture, unwrap, wire_named
from gateway.wire import sniff

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
    side: str = "before"  # the side of a capture measured
    captures: int = 0  # capture files among the payloads
    payloads: int = 0  # request bodies measured (captures included)
    mem_lines: int = 0  # [mem] log records measured
    ignored_lines: int = 0  # log lines that are no request (startup, reloads, errors, text)


# what log pipelines put before a line: `docker compose logs` (`gateway-a-1  | `),
# `kubectl logs --timestamps` (an RFC 3339 timestamp), a logger's time and level: text
# without a quote, a brace or an `=`, so a client's value can never pass for the marker
_PREFIX = r'[^"{}=\n]*?'
_CONSOLE = re.compile(_PREFIX + r"\[mem\] ")
_JSON_LINE = re.compile(_PREFIX + r"(?=\{)")
# k=v, the value bare or an (ASCII) JSON string as gateway/observe/logging.py writes one
_PAIR = re.compile(r'([^\s="]+)=("(?:[^"\\]|\\.)*"|\S*)')


def parse_console(line: str) -> dict[str, str] | None:
    """The fields of a console `[mem]` line (after any pipeline prefix), else None.

    Quoted values are JSON strings (`metadata_reason="a \\"b\\""`) and are decoded;
    a `-` stays `-` (None, as the renderer writes it)."""
    m = _CONSOLE.match(line)
    if m is None:
        return None
    out: dict[str, str] = {}
    for k, v in _PAIR.findall(line, m.end()):
        if v.startswith('"'):
            try:
                v = orjson.loads(v)
            except orjson.JSONDecodeError:
                v = v[1:-1]
        out[k] = v
    return out


def iter_records(paths: list[str], stdin: TextIO) -> Iterator[tuple[str, Any, bytes]]:
    """(where, record, its bytes) for every payload, capture or log line in the inputs;
    a line that is no record (another tool's text) is (where, IGNORED, b"")."""
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
            if f.suffix == ".json":
                raw = f.read_bytes()
                try:
                    yield str(f), orjson.loads(raw), raw
                except orjson.JSONDecodeError:
                    yield str(f), None, raw
            else:
                yield from _lines(str(f), f.read_text(encoding="utf-8", errors="replace"))


IGNORED = object()  # a log line that is not a [mem] record: not a skipped request


def _lines(where: str, text: str) -> Iterator[tuple[str, Any, bytes]]:
    for n, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line:
            continue
        console = parse_console(line)
        if console is not None:
            yield f"{where}:{n}", {"event": "mem", **console}, b""
            continue
        m = _JSON_LINE.match(line)
        if m is None:  # plain text: a startup banner, a traceback, another program's
            yield f"{where}:{n}", IGNORED, b""
            continue
        raw = line[m.end():].encode("utf-8")
        try:
            rec = orjson.loads(raw)
        except orjson.JSONDecodeError:
            yield f"{where}:{n}", None, raw
            continue
        if isinstance(rec, dict) and isinstance(rec.get("event"), str) and rec["event"] != "mem":
            yield f"{where}:{n}", IGNORED, b""  # reload, startup, errors: not requests
        else:
            yield f"{where}:{n}", rec, raw


def measure(
    paths: list[str], rules: Rules, simulate: bool, stdin: TextIO = sys.stdin,
    progress: TextIO | None = None, side: str = "before",
) -> Report:
    """Measure every record; a capture file is measured on `side` (default `before`,
    what the client sent), with the api and session the gateway recorded."""
    measuring = replace(rules, memory=replace(rules.memory, enable_eviction=simulate,
                                              shadow=False))
    tokenizers = Tokenizers(rules.token_cache_size)
    report = Report(simulation=Simulation() if simulate else None, side=side)
    for n, (where, rec, raw) in enumerate(iter_records(paths, stdin), start=1):
        if progress is not None and n % 100 == 0:
            progress.write(f"\rmemgate stats: {n} records")
            progress.flush()
        if rec is IGNORED:
            report.ignored_lines += 1
            continue
        if isinstance(rec, dict) and rec.get("event") == "mem":
            _mem_record(report, where, rec)
            continue
        if not isinstance(rec, dict):
            report.skipped.append(f"{where}: not a JSON object")
            continue
        wire, session = sniff(rec, Path(where).name), None
        if is_capture(rec):
            raw, body, api = unwrap(raw or orjson.dumps(rec), rec, side)
            wire = wire_named(api) or sniff(body, Path(where).name)
            mem = rec.get("mem")
            session = str(mem.get("session")) if isinstance(mem, dict) and mem.get(
                "session") else None
            report.captures += 1
            rec = body
            if not isinstance(rec, dict):
                report.skipped.append(f"{where}: the capture's {side} is not a JSON object")
                continue
        _measure_body(report, where, raw or orjson.dumps(rec), rec, measuring, tokenizers,
                      wire, session)
    if progress is not None:
        progress.write("\r" + " " * 40 + "\r")
    return report


def _mem_record(report: Report, where: str, rec: dict[str, Any]) -> None:
    try:
        got = Sample(str(rec.get("session", "?")), int(rec["hist_msgs"]),
                     int(rec["hist_chars"]), int(rec["est_tokens"]))
    except (KeyError, ValueError, TypeError):
        report.skipped.append(f"{where}: a [mem] record without hist_* fields")
        return
    add_spend(report.spend, rec)  # checks its fields before it counts
    report.samples.append(got)
    report.mem_lines += 1
    budget = rec.get("budget_tokens")
    if isinstance(budget, int | str) and str(budget).isdigit():
        report.budget_tokens = int(budget)


def _measure_body(report: Report, where: str, raw: bytes, rec: dict[str, Any],
                  measuring: Rules, tokenizers: Tokenizers, wire: Any,
                  session: str | None) -> None:
    try:
        d = decide(raw, rec, measuring, tokenizers, wire)
    except GatewayError as exc:
        report.skipped.append(f"{where}: {exc.message}")
        return
    if d.skip_reason is not None and d.conv is None:
        report.skipped.append(f"{where}: {d.skip_reason}")
        return
    msgs = d.messages
    if session is None:  # what the gateway would name it, from the body alone
        session = first_named(measuring.session_id_from, {}, rec, msgs, "offline",
                              measuring.memory.context_prefixes)[0]
    tokens = d.est_tokens()
    report.samples.append(Sample(session, len(msgs), d.hist_chars(), tokens))
    report.payloads += 1
    report.budget_tokens = d.budget_tokens
    sim, p = report.simulation, d.plan
    if sim is not None and p is not None:
        if p.dropped:
            sim.evicted += 1
            sim.messages_dropped += len(p.dropped)
            sim.tokens_dropped += tokens - d.kept_tokens()
        sim.pins_kept += p.pinned
        sim.over_budget += int(p.over_budget)


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
    out: dict[str, Any] = {"requests": len(s), "skipped": len(report.skipped),
                           "sources": sources(report)}
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


def sources(report: Report) -> dict[str, Any]:
    """What was read: request bodies (captures among them, and their side), [mem] lines,
    and the log lines that are no request at all (not counted as skipped)."""
    out: dict[str, Any] = {"payloads": report.payloads, "mem_lines": report.mem_lines,
                           "other_log_lines": report.ignored_lines}
    if report.captures:
        out.update(captures=report.captures, capture_side=report.side)
    return out


def describe_sources(src: dict[str, Any]) -> str:
    parts = [f"{src['payloads']} payloads"]
    if src.get("captures"):
        side = src["capture_side"]
        parts[0] += (f" ({src['captures']} captures, side `{side}`: {SIDE_MEANS[side]})")
    parts.append(f"{src['mem_lines']} [mem] lines")
    if src["other_log_lines"]:
        parts.append(f"{src['other_log_lines']} other log lines ignored")
    return ", ".join(parts)


def render_table(s: dict[str, Any]) -> str:
    lines = [f"requests {s['requests']}   skipped {s['skipped']}",
             f"read: {describe_sources(s['sources'])}"]
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


def plot(report: Report, path: str, budget: int | None, source: str = "",
         log: bool = False) -> str | None:
    """Histogram of tokens per request: title with N and the source, p50/p90/p99 and the
    budget as labelled lines; `log` for a log-scaled x axis (long tails). An error text
    when it cannot be drawn."""
    tokens = [x.tokens for x in report.samples]
    if not tokens:
        return "--plot: no request was measured, nothing to draw"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("--plot needs matplotlib: pip install -e '.[plot]' in a checkout "
                "(or pip install matplotlib)")
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    fig, ax = plt.subplots(figsize=(11, 5.5), dpi=110)
    lo, hi = max(1, min(tokens)), max(max(tokens), budget or 0, 2)
    if log:
        edges = [lo * 0.95 * (hi * 1.05 / (lo * 0.95)) ** (i / 50) for i in range(51)]
        ax.set_xscale("log")
    else:
        edges = [hi * 1.05 * i / 50 for i in range(51)]
    ax.hist(tokens, bins=edges, color="#4c78a8", edgecolor="white", label="requests")
    marks: dict[int, list[str]] = {}
    for q in (50, 90, 99):  # equal percentiles share one line and one legend entry
        marks.setdefault(percentile(tokens, q), []).append(f"p{q}")
    styles = iter([("#2a9d3f", ":"), ("#e08a00", "-."), ("#7b3fa0", (0, (5, 2)))])
    for value, names in marks.items():
        color, style = next(styles)
        ax.axvline(value, color=color, linestyle=style, linewidth=1.8,
                   label=f"{' = '.join(names)}: {value:,}")
    if budget:
        ax.axvline(budget, color="#c0392b", linestyle="--", linewidth=2.4,
                   label=f"budget: {budget:,}")
    ax.set_title(f"memgate stats: estimated tokens per request (N={len(tokens):,})",
                 fontsize=13)
    if source:
        fig.text(0.01, 0.01, f"source: {source}"[:160], fontsize=8, color="#555")
    ax.set_xlabel("estimated tokens per request" + (" (log scale)" if log else ""))
    ax.set_ylabel("requests")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    thousands = FuncFormatter(lambda v, _pos: f"{v:,.0f}")
    ax.xaxis.set_major_formatter(thousands)
    if log:
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda _v, _pos: ""))
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), framealpha=0.9)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path)
    plt.close(fig)
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
