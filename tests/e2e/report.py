"""What the agent-CLI runs tell: pair each request the client sent with the one memgate
forwarded, compare them (shadow mode: byte for byte), and report per request what
eviction kept of the session (tokens, the first task's text and answer, the opening
message's client context), memgate's `session=` and the session ids the client sent.
Used by test_agent_clis.py and probe.py; the report is data for issue #41, not asserted.
"""

from __future__ import annotations

import json
from typing import Any

from tests.e2e.harness import TASK1, Session, WireRequest, mem_fields
from tests.e2e.mock_model import AGENTS_MD_MARK, CLAUDE_MD_MARK, strings_in

HOP_BY_HOP = frozenset(("connection", "keep-alive", "transfer-encoding", "te", "trailer",
                        "upgrade", "proxy-connection", "proxy-authorization", "host",
                        "content-length"))
CHAT_PATHS = ("/v1/messages", "/v1/responses", "/v1/chat/completions")


def is_chat(req: WireRequest) -> bool:
    path = req.target.split("?", 1)[0]
    return req.method == "POST" and path in CHAT_PATHS


def _tail_key(req: WireRequest) -> str:
    body = req.json()
    if not isinstance(body, dict):
        return ""
    items = body.get("messages", body.get("input"))
    if isinstance(items, list) and items:
        return json.dumps(items[-1], sort_keys=True)
    return json.dumps(items, sort_keys=True)


def pair(sent: list[WireRequest], forwarded: list[WireRequest]
         ) -> list[tuple[WireRequest, WireRequest | None]]:
    """Each request the client sent with the one memgate forwarded for it: the same
    bytes if there is one, else the same path and last message (the current turn is never
    cut), else the next of the same path in order."""
    free = list(forwarded)
    out: list[tuple[WireRequest, WireRequest | None]] = []
    for s in sent:
        match = next((f for f in free if f.method == s.method and f.target == s.target
                      and f.body == s.body), None)
        if match is None:
            key = _tail_key(s)
            match = next((f for f in free if f.target == s.target and key
                          and _tail_key(f) == key), None)
        if match is None:
            match = next((f for f in free if f.method == s.method and f.target == s.target),
                         None)
        if match is not None:
            free.remove(match)
        out.append((s, match))
    return out


def header_differences(sent: WireRequest, got: WireRequest) -> list[str]:
    """Client headers (end-to-end ones) that did not reach the mock as sent."""
    have: dict[str, list[str]] = {}
    for k, v in got.headers:
        have.setdefault(k.lower(), []).append(v)
    out = []
    for k, v in sent.headers:
        if k.lower() in HOP_BY_HOP:
            continue
        if v not in have.get(k.lower(), []):
            out.append(f"{k}: sent {v[:80]!r}, got {have.get(k.lower())!r}"[:240])
    return out


def byte_differences(session: Session) -> list[str]:
    """Where what reached the mock differs from what the client sent (shadow: none)."""
    problems = []
    if len(session.sent) != len(session.forwarded):
        problems.append(f"client sent {len(session.sent)} requests, "
                        f"mock got {len(session.forwarded)}")
    for n, (s, f) in enumerate(pair(session.sent, session.forwarded)):
        where = f"request {n} {s.method} {s.target}"
        if f is None:
            problems.append(f"{where}: never reached the mock")
            continue
        if f.target != s.target:
            problems.append(f"{where}: forwarded as {f.target}")
        if f.body != s.body:
            problems.append(f"{where}: body differs ({len(s.body)} bytes sent, "
                            f"{len(f.body)} forwarded)")
        problems += [f"{where}: header {d}" for d in header_differences(s, f)]
    return problems


# ---------------------------------------------------------------------------- report


def _texts(req: WireRequest | None) -> str:
    if req is None:
        return ""
    body = req.json()
    return "\n\x00".join(strings_in(body)) if body is not None else ""


def opening_context(client: str, sent: list[WireRequest]) -> list[str]:
    """The client context of the session's opening message, as texts: Claude Code's
    `<system-reminder>` blocks of its first user message; Codex's AGENTS.md /
    `<user_instructions>` / `<environment_context>` items before the first task."""
    for req in sent:
        body = req.json()
        if not is_chat(req) or not isinstance(body, dict):
            continue
        if client == "claude":
            msgs = body.get("messages") or []
            if not msgs or not isinstance(msgs[0].get("content"), list) or not body.get("tools"):
                continue
            return [b["text"] for b in msgs[0]["content"] if isinstance(b, dict)
                    and isinstance(b.get("text"), str)
                    and b["text"].lstrip().startswith("<system-reminder>")]
        items = body.get("input") or []
        out = []
        for item in items:
            if not isinstance(item, dict) or item.get("role") != "user":
                continue
            text = "\n".join(strings_in(item.get("content")))
            if "TASK1" in text:
                break
            for part in item.get("content") or []:
                t = part.get("text", "") if isinstance(part, dict) else ""
                if any(m in t for m in ("<environment_context>", "AGENTS.md instructions",
                                        "<user_instructions>")):
                    out.append(t)
        if out:
            return out
    return []


def session_ids(req: WireRequest) -> dict[str, str]:
    """The session / conversation ids a client put in a request's headers and body."""
    out: dict[str, str] = {}
    for k, v in req.headers:
        kl = k.lower()
        if kl in ("x-claude-code-session-id", "session-id", "session_id", "thread-id",
                  "conversation_id", "conversation-id", "x-client-request-id",
                  "x-codex-window-id", "x-session-id"):
            out[f"h:{kl}"] = v
    body = req.json()
    if isinstance(body, dict):
        meta = body.get("metadata")
        if isinstance(meta, dict) and isinstance(meta.get("user_id"), str):
            uid = meta["user_id"]
            try:
                parsed = json.loads(uid)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                for k in ("session_id", "device_id", "account_uuid"):
                    if parsed.get(k):
                        out[f"b:metadata.user_id.{k}"] = str(parsed[k])
            else:
                out["b:metadata.user_id"] = uid
        if isinstance(body.get("prompt_cache_key"), str):
            out["b:prompt_cache_key"] = body["prompt_cache_key"]
        cm = body.get("client_metadata")
        if isinstance(cm, dict):
            for k in ("session_id", "thread_id", "x-codex-installation-id"):
                if isinstance(cm.get(k), str):
                    out[f"b:client_metadata.{k}"] = cm[k]
    return out


def _tokens(ev: dict[str, str] | None, key: str) -> int | None:
    if ev is None or not ev.get(key, "").isdigit():
        return None
    return int(ev[key])


def report(session: Session) -> list[dict[str, Any]]:
    """Per chat request the client sent: tokens sent vs forwarded (memgate's estimate),
    bytes, whether the forwarded body still holds the first task's request text and its
    final answer and the opening message's client context, memgate's session=, and the
    session ids the client sent."""
    sent = [r for r in session.sent if is_chat(r)]
    forwarded = [r for r in session.forwarded if is_chat(r)]
    events = [mem_fields(ln) for ln in session.mem_lines]
    used: set[int] = set()
    context = opening_context(session.client, sent)
    mark = CLAUDE_MD_MARK if session.client == "claude" else AGENTS_MD_MARK
    task1_seen = False
    rows = []
    for n, (s, f) in enumerate(pair(sent, forwarded)):
        parsed = s.json()
        body = parsed if isinstance(parsed, dict) else {}
        items = body.get("messages", body.get("input"))
        hist = len(items) if isinstance(items, list) else 1
        ev = None
        for i, e in enumerate(events):
            if i not in used and e.get("hist_msgs") == str(hist) and e.get("model") == str(
                    body.get("model", e.get("model"))):
                ev = e
                used.add(i)
                break
        fwd_text, sent_text = _texts(f), _texts(s)
        task1_seen = task1_seen or TASK1 in sent_text
        rec = None
        if session.model is not None:
            rec = next((r for r in session.model.received
                        if f is not None and r.raw == f.body and r.path == f.target), None)
        rows.append({
            "n": n,
            "role": rec.role if rec else "?",
            "step": (f"T{rec.task}.{rec.round}" if rec and rec.task else "-"),
            "hist": hist,
            "fwd_hist": _count_items(f),
            "tok_sent": _tokens(ev, "est_tokens"),
            "tok_fwd": _tokens(ev, "est_sent_tokens") or _tokens(ev, "est_tokens"),
            "bytes_sent": len(s.body),
            "bytes_fwd": len(f.body) if f else None,
            "task1_text": (TASK1 in fwd_text) if task1_seen else None,
            "task1_answer": ("TASK1-DONE:" in fwd_text) if "TASK1-DONE:" in sent_text else None,
            "context": (f"{sum(c in fwd_text for c in context)}/{len(context)}"
                        if context and any(c in sent_text for c in context) else "-"),
            "instructions": (mark in fwd_text) if mark in sent_text else None,
            "dropped": ev.get("dropped") if ev else None,
            "note": ev.get("note") == "1" if ev else False,
            "mode": ev.get("mode") if ev else None,
            "evict": ev.get("evict") if ev else None,
            "session": ev.get("session") if ev else None,
            "ids": session_ids(s),
        })
    return rows


def _count_items(req: WireRequest | None) -> int | None:
    body = req.json() if req is not None else None
    if not isinstance(body, dict):
        return None
    items = body.get("messages", body.get("input"))
    return len(items) if isinstance(items, list) else 1


def format_report(session: Session, rows: list[dict[str, Any]] | None = None) -> str:
    rows = report(session) if rows is None else rows
    mode = "eviction ON" if session.eviction else "eviction off (shadow)"
    lines = [f"== {session.client} through memgate, {mode}: "
             + ", ".join(f"run{i + 1} exit={r.returncode} {r.seconds:.1f}s"
                         for i, r in enumerate(session.runs))]
    for i, r in enumerate(session.runs):
        last = r.stdout.strip().splitlines()[-1:] or ["<no stdout>"]
        lines.append(f"   run{i + 1} stdout: {last[0][:150]}")
    head = (f"{'#':>3} {'role':<10} {'step':<5} {'msgs':>9} {'tok sent':>8} {'tok fwd':>8} "
            f"{'bytes sent':>10} {'bytes fwd':>10} {'T1 text':>7} {'T1 ans':>6} "
            f"{'context':>7} {'instr':>5} {'dropped':>7} {'evict':<7} memgate session")
    lines.append(head)

    def yn(v: Any) -> str:
        return "-" if v is None else ("yes" if v else "NO")

    for r in rows:
        msgs = f"{r['hist']}>{r['fwd_hist']}"
        dropped = f"{r['dropped'] or '?'}{'+note' if r['note'] else ''}"
        lines.append(
            f"{r['n']:>3} {r['role']:<10} {r['step']:<5} {msgs:>9} {r['tok_sent'] or '?':>8} "
            f"{r['tok_fwd'] or '?':>8} {r['bytes_sent']:>10} {r['bytes_fwd'] or '?':>10} "
            f"{yn(r['task1_text']):>7} {yn(r['task1_answer']):>6} {r['context']:>7} "
            f"{yn(r['instructions']):>5} "
            f"{dropped:>7} {r['evict'] or '?':<7} {r['session']}")
    ids: dict[str, set[str]] = {}
    for r in rows:
        for k, v in r["ids"].items():
            ids.setdefault(k, set()).add(v)
    lines.append("   session ids the client sent (distinct values over the session):")
    for k, vs in sorted(ids.items()):
        lines.append(f"     {k} = {', '.join(sorted(vs))[:160]}")
    sessions = sorted({r["session"] for r in rows if r["session"]})
    lines.append(f"   memgate session= values: {', '.join(sessions) or '-'}")
    foreign = sorted({a for r in session.runs for a in r.foreign_addresses()})
    traced = any(r.trace is not None for r in session.runs)
    lines.append("   non-loopback addresses the client tried: "
                 + (", ".join(foreign) or "none") if traced else
                 "   non-loopback addresses: not traced (strace unavailable)")
    return "\n".join(lines)
