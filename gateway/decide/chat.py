"""One request from bytes to decision: parse, measure, plan (or take a shortcut).

`decide` parses the history (through the session's history cache: only what it appended
is parsed and counted), tells from the body's size or an exact count whether all of it
fits (then it is not planned), plans it under the budget (compact_tools and the carry
note counted in), and has the forwarded body built. Shared by the server handler and
`memgate evict`, so the CLI explains exactly what the gateway would forward. Works for
every wire format. No I/O, no logging.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from gateway.config.schema import Rules
from gateway.decide.carry_note import carry_note, minus_note, note_room
from gateway.decide.compact_tools import compact, compactable, excerpted, results_of
from gateway.decide.decision import Decision
from gateway.decide.forward_body import build_forward
from gateway.decide.history import HistoryCache
from gateway.decide.retrieve import carries_tool, may_retrieve
from gateway.decide.splice import Splice
from gateway.errors import BadRequest, OverBudget
from gateway.measure.conversation import (
    META_KEY,
    BadMetadata,
    Conversation,
    Unplannable,
    read_metadata,
)
from gateway.measure.tokens import Tokenizers
from gateway.policy import Limits, Plan, PlanRules, plan
from gateway.policy.plan import fits_unplanned
from gateway.wire.base import Wire
from gateway.wire.openai_chat import OPENAI_CHAT

# the most of a malformed-metadata reason logged or answered (it can quote a client's key)
REASON_CHARS = 200
# text of a history not counted yet (a new turn; all of a cold history) that is counted
# before the plan to tell whether all of it fits (~0.5 ms of counting at most)
EXACT_CHARS = 16_384


def budget_tokens(rules: Rules, payload: dict[str, Any], model: str | None) -> int | None:
    b = rules.memory.budget
    if b.max_tokens != "auto":
        return b.max_tokens
    window = rules.model_info(model).context_window
    reserve = (
        payload.get("max_completion_tokens")
        or payload.get("max_output_tokens")
        or payload.get("max_tokens")
    )
    if not isinstance(reserve, int) or isinstance(reserve, bool) or reserve < 0:
        reserve = b.reserve_output_tokens
    return max(1, int((window - reserve) * b.safety_ratio))


def plan_rules(rules: Rules, max_tokens: int | None) -> PlanRules:
    hit: PlanRules | None = rules.memo.get(("plan_rules", max_tokens))
    if hit is not None:
        return hit
    m = rules.memory
    hit = PlanRules(
        limits=Limits(
            max_tokens=max_tokens,
            max_chars=m.budget.max_chars,
            max_messages=m.budget.max_messages,
            max_turns=m.budget.max_turns,
            # auto is the model's window: the whole request has to fit it
            tokens_whole=m.budget.max_tokens == "auto",
        ),
        # compact_tools runs around the planner (compact_tools.py), not as one of its stages
        order=tuple(s for s in m.eviction.order if s != "compact_tools"),
        keep_pinned=m.eviction.keep_pinned,
        max_pinned=m.eviction.max_pinned,
        drop_unit=m.eviction.drop_unit,
        min_score=m.markers.min_score,
        low_water=m.eviction.low_water,
        recall_share=m.eviction.recall_share,
        shortcuts_off=rules.shortcuts_off,
    )
    rules.remember(("plan_rules", max_tokens), hit)
    return hit


def decide(
    raw: bytes, payload: Any, rules: Rules, tokenizers: Tokenizers, wire: Wire = OPENAI_CHAT,
    recalled: list[str] | None = None, history: HistoryCache | None = None,
    key: tuple[str, str] | None = None, default_model: str | None = None,
    archive_in: str | None = None, spliced: Splice | None = None,
) -> Decision:
    """Plan one request; raises BadRequest / OverBudget for the client.

    With a `history` cache and the session's `key`, only what the session appended
    since its previous request is parsed, counted and folded. `default_model` is the
    model of a body that names none (an Azure deployment route names it in the path).
    `archive_in`: the tenant whose store will archive the originals of compacted tool
    results (their markers then name the archive ids). `spliced`: the session's record
    `raw` was parsed with (history.loads), whose item spans a cut reuses."""
    model = payload.get("model") if isinstance(payload, dict) else None
    model = model if isinstance(model, str) else default_model
    counter = tokenizers.get(rules.model_info(model).encoding)
    if wire.approx_tokens:
        counter = counter.scaled(rules.approx_token_factor)
    d = Decision(
        raw=raw, payload=payload, wire=wire, mode=rules.memory.mode, model=model,
        counter=counter, forward=raw,
        spliced_from=spliced,
    )
    if payload is None:
        d.skip_reason = "invalid_json"
        return d
    try:
        return _plan_into(d, rules, wire, recalled, history, key, archive_in)
    except orjson.JSONEncodeError:
        # nested deeper than orjson writes (255..1024 levels): counting cannot read it,
        # the client's bytes go as they came
        return Decision(raw=raw, payload=payload, wire=wire, mode=d.mode, model=model,
                        counter=counter, forward=raw,
                        skip_reason="nested_too_deep", _items=[], _overhead=0,
                        spliced_from=spliced)


def _plan_into(
    d: Decision, rules: Rules, wire: Wire, recalled: list[str] | None,
    history: HistoryCache | None, key: tuple[str, str] | None, archive_in: str | None = None,
) -> Decision:
    """`decide` once the body is known to be JSON: parse, plan, build the forward."""
    payload = d.payload
    if not isinstance(payload, dict):
        d.skip_reason = "not_an_object"
        return d
    items = wire.items(payload)
    if items is None:
        d.skip_reason = "no_messages"
        return d
    d.budget_tokens = budget_tokens(rules, payload, d.model)
    # before the parse: with server-side state a result may answer a call the server
    # holds, which is no pairing error (and nothing client-side to evict)
    d.skip_reason = wire.skip_reason(payload)
    if not _parse(d, rules, wire, items, history, key):
        return d
    assert d.conv is not None
    d.conv.outside_chars = wire.fixed_chars(payload)
    d.conv.current = _input_began(d.conv, wire, items)
    if d.mode != "off" and d.skip_reason is None:
        may_retrieve(d, rules, key)
        _plan(d, rules, items, recalled, archive_in)
        if carries_tool(d):
            d.retrieve = rules.memory.retrieve.tool_name
    if d.plan is not None and d.plan.dropped:
        # the parse lists the marked messages: not a look at every dropped one
        kept = d.plan.kept
        d.cache_marker_dropped = wire.cache_markers and any(
            not _holds(kept, i) for i in d.conv.cache_marked)
    build_forward(d, rules, items)
    return d


def _parse(d: Decision, rules: Rules, wire: Wire, items: list[Any],
           history: HistoryCache | None, key: tuple[str, str] | None) -> bool:
    """Parse the history into `d.conv` (and `d.view`, through the session's cache); False
    if it cannot be planned (`d.skip_reason` says why). Malformed memgate metadata is
    ignored (cut out, logged), or refused with BadRequest when eviction is on and the
    rules say reject."""
    markers = rules.memory.markers
    context = rules.memory.context_prefixes
    try:
        if d.skip_reason is not None:  # never planned: the session's cache saves nothing
            d.conv = wire.parse_continuation(items, markers.system_prefix, markers.min_score)
        elif history is not None and key is not None:
            d.view = history.parse(key, wire, items, rules, len(d.raw), markers.system_prefix,
                                   markers.min_score, context)
            d.conv = d.view.conv
            d.reuse_counts()
        else:
            d.conv = wire.parse(items, markers.system_prefix, markers.min_score, context)
    except Unplannable as exc:
        d.skip_reason = exc.reason
        return False
    except BadMetadata as exc:
        # only eviction on may refuse a request, and only if told to: the kill switch
        # never breaks a call
        reason = str(exc)[:REASON_CHARS]
        if d.mode == "on" and markers.on_bad_metadata == "reject":
            raise BadRequest(reason) from None
        d.bad_metadata = reason
        try:
            d.conv = wire.parse(_without_bad_metadata(items), markers.system_prefix,
                                markers.min_score, context)
        except Unplannable as unplannable:
            d.skip_reason = unplannable.reason
            return False
        d.conv.has_metadata = True  # the bad blocks are cut out of the forward too
    return True


def _plan(d: Decision, rules: Rules, items: list[Any], recalled: list[str] | None,
          archive_in: str | None) -> None:
    """Plan the parsed history into `d.plan`: not at all when its size says it fits;
    with compact_tools when the plan has to drop; again when the carry note does not fit
    the slack the cut left. Raises OverBudget when eviction is on and the rules say
    reject."""
    assert d.conv is not None
    prules = plan_rules(rules, d.budget_tokens)
    overhead = d.overhead_tokens() if d.budget_tokens is not None else 0
    counted_by = d.counter  # one per encoding and factor; not the session `key`
    text_of = _text_of(d.wire, items)
    room = note_room(d, rules, items, recalled) if d.mode == "on" else None
    bound = _bytes_bound(d.raw, d)
    exact = _exact_tokens(d, rules, prules.limits.max_tokens, overhead, bound)
    if exact is not None:
        bound = min(bound, exact)
    cutting = ("compact_tools" in rules.memory.eviction.order
               and not fits_unplanned(d.conv, prules.limits, bound))
    least = rules.memory.retrieve.excerpt_min_chars
    # (a result that long is an item with that much text: no scan for results without)
    excerpts = (d.handles_in is not None and least is not None
                and max(d.conv.text_chars, default=0) >= least)
    results = results_of(d, rules) if cutting or excerpts else []
    todo, spare = compactable(d, rules, results) if cutting else ({}, {})
    big = excerpted(d, rules, results)  # memory.retrieve: excerpted whatever the cut
    for i, rs in big.items():
        todo[i] = todo.get(i, []) + [r for r in rs if r not in todo.get(i, ())]
    # with tool results to compact, this plan only tells whether the history is cut
    # (the stages under the whole budget): it is planned again either way, so the
    # stable part's second pass and the fill are not run for it
    probe = bool(todo or spare)
    d.plan = plan(d.conv, prules, d.message_tokens, overhead_tokens=overhead,
                  tokens_upper_bound=bound, tokens_key=counted_by,
                  text_of=None if probe else text_of, reserve=None if probe else room,
                  tokens_exact=exact, cuttable=todo)
    # over budget with nothing to drop: an agent loop's one long current turn
    if probe and (d.plan.dropped or d.plan.over_budget):
        client_conv = d.conv
        for _ in range(2):
            compacted = compact(d, rules, todo, archive_in)
            counts = d.planned_tokens if compacted else d.message_tokens
            d.plan = plan(d.conv, prules, counts, overhead_tokens=overhead,
                          tokens_key=counted_by, text_of=text_of, reserve=room,
                          cuttable=todo)
            # keep_recent holds the newest results whole, but not at the price of
            # their turn: those the plan dropped are compacted too, and planned again
            lost = {i: rs for i, rs in spare.items() if not _holds(d.plan.kept, i)}
            if not lost:
                break
            # (an item's older results first, as in `todo`: these are the newest)
            todo = {**todo, **{i: todo.get(i, []) + rs for i, rs in lost.items()}}
            spare = {}
            d.conv, d.compacted, d.compact_tokens, d.archived = client_conv, {}, {}, {}
            d.retrievable = {}
    elif big and compact(d, rules, big, archive_in):  # nothing to cut: the big ones only
        d.plan = plan(d.conv, prules, d.planned_tokens, overhead_tokens=overhead,
                      tokens_key=counted_by, text_of=text_of, reserve=room, cuttable=big)
    if d.noted and not d.plan.dropped:  # the fill brought back all the stages dropped
        d.noted, d.note, d.snapshot, d.recalled = False, None, None, []
    if d.mode == "on" and (d.plan.dropped or recalled) and (
            d.note is not None if d.noted else carry_note(d, rules, items, recalled)):
        # the note is counted into the budget: plan again unless it fits the slack
        # the cut left (the fill left the note room when it ran: it fits, unless the
        # stable part alone leaves too little)
        assert d.note is not None
        if d.handles_in is not None and not _note_fits(prules.limits, d):
            # a budget smaller than the note alone (with the retrieval line every note is
            # a few dozen tokens): the note is not forwarded, so what goes stays within
            # the budget (no marker names the dropped turns' handle then)
            d.note, d.snapshot, d.recalled = None, None, []
        else:
            narrower = minus_note(prules, d)
            # with the retrieval tool and no fill, a cut always brings the note (its line
            # names the dropped turns' handle): the cut is made under the budget less the
            # note every time, not only when the slack happens to be too small, which
            # would move a stepped cut back and forth (a prompt-cache miss each time)
            always = d.handles_in is not None and not prules.recall_share
            if always or not _fits(d.plan, narrower.limits):
                d.plan = plan(d.conv, narrower, d.planned_tokens, overhead_tokens=overhead,
                              tokens_key=counted_by, text_of=text_of, cuttable=todo)
    if (
        d.mode == "on"
        and d.plan.over_budget
        and rules.memory.eviction.on_over_budget == "reject"
    ):
        if prules.limits.tokens_whole and (d.plan.kept_tokens or 0) > (d.budget_tokens or 0):
            raise OverBudget(
                "the system prompt, tools, pinned messages and the current turn alone "
                f"exceed the model's window as the gateway counts it (max_tokens: auto = "
                f"{d.budget_tokens} tokens for this request); shorten the current turn")
        raise OverBudget(
            "the pinned messages alone exceed the gateway's history budget "
            f"(max_tokens={d.budget_tokens}, max_chars={rules.memory.budget.max_chars}, "
            f"max_messages={rules.memory.budget.max_messages}; the token and character "
            "budgets count the history on top of the system prompt, tools and the current "
            "turn); unpin some or shorten them"
        )


def _without_bad_metadata(items: list[Any]) -> list[Any]:
    """The items with each malformed memgate block left out (the message is then pinned
    by its text prefix alone); the body forwarded is still made from `items`."""
    out = list(items)
    for i, m in enumerate(items):
        if isinstance(m, dict) and META_KEY in m:
            try:
                read_metadata(m[META_KEY], "")
            except BadMetadata:
                out[i] = {k: v for k, v in m.items() if k != META_KEY}
    return out


def _text_of(wire: Wire, items: list[Any]) -> Callable[[int], str]:
    """Message i's text, what the fill ranks dropped history by."""
    return lambda i: wire.item_text(items[i])


def _holds(ascending: Sequence[int], i: int) -> bool:
    k = bisect.bisect_left(ascending, i)
    return k < len(ascending) and ascending[k] == i


def _fits(p: Plan, lim: Limits) -> bool:
    """Does the plan's history fit `lim` (on top of the floor, as the planner counts)?"""
    floor = 0 if lim.tokens_whole else p.fixed_tokens or 0
    return (
        (lim.max_tokens is None
         or (p.kept_tokens is not None and p.kept_tokens - floor <= lim.max_tokens))
        and (lim.max_chars is None or p.kept_chars - p.fixed_chars <= lim.max_chars)
        and (lim.max_messages is None or len(p.kept) <= lim.max_messages)
    )


def _note_fits(lim: Limits, d: Decision) -> bool:
    """Does the carry note alone fit every budget limit (on top of the floor)?"""
    tokens, chars, messages = d.note_cost()
    return ((lim.max_tokens is None or lim.tokens_whole or tokens < lim.max_tokens)
            and (lim.max_chars is None or chars < lim.max_chars)
            and (lim.max_messages is None or messages < lim.max_messages))


def _input_began(conv: Conversation, wire: Wire, items: list[Any]) -> int | None:
    """The turn where the caller's input since the model's last reply began, when that is
    before the last turn: Anthropic merges consecutive user messages into one turn (a
    document, then the question about it; tool results, then a new instruction), and a
    model answers all of a chat's user messages since its reply. None: the last turn."""
    k = len(items)
    while k and wire.continues_input(items[k - 1]):
        k -= 1
    if k >= len(items):
        return None
    g = conv.group_of(k)
    if g is None:  # a fixed item (the opening context) begins the input: its next group
        g = bisect.bisect_left(conv.groups, k, key=lambda grp: grp.indices[0])
        if g == len(conv.groups):
            return None
    turn = conv.groups[g].turn
    return turn if turn < conv.n_turns else None


def _exact_tokens(d: Decision, rules: Rules, limit: int | None, overhead: int, bound: int
                  ) -> int | None:
    """The request's tokens (the [mem] line's est_tokens, counted for it anyway), when the
    body's bytes do not bound them under the budget already and at most EXACT_CHARS of
    its text is not counted yet (a session's cache holds the rest): a history that fits
    is then not planned (MEMGATE_SHORTCUTS_OFF=exactfit: it is). `bound`: _bytes_bound.
    Not while the session's counts of the items it knows have gaps (a concurrent request
    of the session, a body decided again): those would be counted here too."""
    if (limit is None or bound <= limit or d.uncounted_chars() > EXACT_CHARS
            or "exactfit" in rules.shortcuts_off):
        return None
    if not d.known_counted():
        return None
    return overhead + d.all_message_tokens()


def _bytes_bound(raw: bytes, d: Decision) -> int:
    """Tokens never exceed the body's bytes (a token is at least one byte) scaled like
    the text counts, with each media part's payload bytes replaced by its cost."""
    conv = d.conv
    media_tokens, media_chars = (conv.media_tokens, conv.media_chars) if conv else (0, 0)
    return math.ceil((len(raw) - media_chars) * d.counter.factor) + media_tokens
