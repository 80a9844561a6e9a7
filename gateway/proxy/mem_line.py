"""The fields of the one `[mem]` line an intercepted request writes, and the writing.

`mem_fields` turns a decision into the line's measurement and plan fields (what came,
what the plan kept, dropped, pinned, compacted and recalled); `log_mem` puts the line
together in its fixed order (the request's fields, mode, model, status, timings, usage,
req, then the rest) and hands the same fields to the capture, the metrics and the
observers.
"""

from __future__ import annotations

from typing import Any

from gateway.decide.decision import Decision
from gateway.observe.capture import record as capture_record
from gateway.observe.relayed import Relayed
from gateway.observe.usage import log_fields as usage_log_fields
from gateway.proxy.appstate import GatewayState
from gateway.wire.base import Wire


def mem_fields(
    d: Decision | None, include_indices: bool, est_tokens: int | None = None
) -> dict[str, Any]:
    """The measurement and plan part of the [mem] line."""
    if d is None:
        return {"hist_msgs": 0, "hist_chars": 0, "est_tokens": 0, "budget_tokens": None,
                "evict": "skipped", "kept": 0, "dropped": 0, "pinned": 0}
    msgs = d.messages
    turn = d.conv.n_turns if d.conv is not None else sum(
        1 for m in msgs if isinstance(m, dict) and m.get("role") == "user"
    )
    f: dict[str, Any] = {
        "turn": turn,
        "hist_msgs": len(msgs),
        "hist_chars": d.hist_chars(),
        "est_tokens": d.est_tokens() if est_tokens is None else est_tokens,
        "budget_tokens": d.budget_tokens,
    }
    if d.conv is not None and d.conv.media_parts:  # only then: text traffic's line unchanged
        f["media"] = d.conv.media_parts
    p = d.plan
    if p is not None and p.fixed_tokens is not None:
        # the floor: system, tools, opening context, the current turn; the token budget
        # counts the history on top of it (a plan that kept everything counted none)
        f["fixed_tokens"] = p.fixed_tokens
    if d.skip_reason is not None:
        f.update(evict="skipped", kept=len(msgs), dropped=0, pinned=0, reason=d.skip_reason)
    elif p is None:  # mode=off: measured, not planned
        f.update(evict="none", kept=len(msgs), dropped=0, pinned=0)
    elif d.mode == "on":
        f.update(evict=p.evict, kept=len(p.kept), dropped=len(p.dropped), pinned=p.pinned)
        if p.dropped or d.compacted:  # the estimate of what went (est_tokens: what came)
            f["est_sent_tokens"] = d.kept_tokens()
            f["sent_chars"] = d.sent_chars()  # what went, as hist_chars measures what came
        if d.note is not None:  # the injected carry note: forwarded = kept + note
            f["note"] = 1
        if p.recalled:  # dropped history the fill brought back (counted in kept)
            f.update(recalled=len(p.recalled), recalled_tokens=p.recalled_tokens)
    else:
        f.update(evict="none", kept=len(msgs), dropped=0, pinned=p.pinned,
                 would_drop=len(p.dropped))
        if p.dropped:
            f["would_evict"] = p.evict
    if d.retrieve is not None:  # the forwarded body carries the retrieval tool
        f["retrieve"] = "tool"
    elif d.retrieve_off is not None and p is not None and (p.dropped or d.compacted):
        f["retrieve"] = d.retrieve_off  # cut, but the request may not carry the tool
    if d.bad_metadata is not None:
        f.update(metadata="invalid", metadata_reason=d.bad_metadata)
    if p is not None:
        n, saved = d.compacted_kept()
        if n:  # in shadow mode: what would be compacted
            f.update(compacted=n, compacted_saved_tokens=saved)
        if p.over_budget:
            f["over_budget"] = True
        if p.pinned_overflow:
            f["pinned_overflow"] = p.pinned_overflow
        if include_indices and p.dropped:
            f["kept_idx"] = ",".join(map(str, p.kept))
            f["dropped_idx"] = ",".join(f"{i}:{s}" for i, s in p.dropped)
    return f


def log_mem(
    state: GatewayState,
    wire: Wire,
    d: Decision | None,
    info: Relayed,
    overhead_ms: float,
    rid: str,
    measured: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    """The [mem] line, the capture and the metrics: what needs the answer too."""
    head, tail = measured
    fields = {
        **head,
        "mode": d.mode if d is not None else state.rules.memory.mode,
        "model": d.model if d is not None else None,
        "status": info.status or 499,
        "upstream_ms": round(info.upstream_ms, 2),
        "overhead_ms": round(overhead_ms, 2),
        **usage_log_fields(info.usage),  # only what the provider sent
        "req": rid,
        **tail,
    }
    if info.stream != "complete":
        fields["stream"] = info.stream
    if info.first_status:
        fields.update(fallback="original", first_status=info.first_status)
    if info.retrieve_rounds:  # rounds memgate asked after answering its retrieval tool
        fields.update(retrieve_rounds=info.retrieve_rounds,
                      retrieve_ms=round(info.retrieve_ms, 2),
                      retrieve_in_tokens=info.retrieve_in, retrieve_out_tokens=info.retrieve_out)
    if info.retrieve_error is not None:
        fields["retrieve_error"] = info.retrieve_error
    state.log.info("mem", **fields)
    if d is not None:
        state.capture.offer(state.rules.capture, rid, lambda: capture_record(
            fields, wire.name, d.raw, d.payload is not None, d.forward))
    state.metrics.observe(wire.name, fields["mode"], d, info, overhead_ms / 1000,
                          fields.get("est_tokens") if d is not None and d.conv else None)
    if info.usage:
        state.metrics.observe_usage(wire.name, state.rules.model_info(fields["model"]).match,
                                    info.usage)
    for observe in state.observers:
        try:
            observe(fields, d, info)
        except Exception as exc:  # noqa: BLE001 - an observer never fails a request
            state.log.error("observer_failed", error=type(exc).__name__,
                            detail=str(exc)[:200], req=rid)
