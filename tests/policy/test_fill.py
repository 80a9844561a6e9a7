"""The budget-filling recall: the ranker on literal inputs, the planner hook, over HTTP."""

from __future__ import annotations

import math
from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import AsyncOpenAI

from gateway.config.rules import build_rules
from gateway.config.schema import Rules
from gateway.decide.chat import decide
from gateway.decide.decision import Decision
from gateway.measure.conversation import Conversation, Group
from gateway.measure.tokens import Tokenizers
from gateway.policy import fill
from tests.conftest import GatewayFactory, Upstream

ROOT = Path(__file__).resolve().parents[2]
TOK = Tokenizers(10_000)


def conv_of(texts: list[str]) -> Conversation:
    """One single-message group per text (turn per message: enough for the ranker)."""
    groups = [Group([i], i + 1, True, len(t)) for i, t in enumerate(texts)]
    return Conversation(n_messages=len(texts), fixed=[], groups=groups, n_turns=len(texts),
                        chars=[len(t) for t in texts])


def test_rank_prefers_rare_matching_terms_then_newer() -> None:
    """BM25: the group holding the question's rare word first; equal scores, newer first."""
    texts = ["the weather was nice", "I adopted a puppy named Rex", "the weather again",
             "the weather"]
    conv = conv_of(texts)
    idx = fill.index_history(conv, len(texts), texts.__getitem__)
    ranked = fill.rank(idx, "What is the name of the puppy?", range(4))
    assert ranked[0] == 1
    # "weather" scores the shorter group higher (length normalisation)
    scores = fill.bm25(idx, ["weather"], {0, 2, 3})
    assert scores[3] > scores[2] > scores[0] > 0.0
    # equal scores: the newer first
    twins = ["a dog named rex", "a dog named rex"]
    assert fill.rank(fill.index_history(conv_of(twins), 2, twins.__getitem__), "rex",
                     range(2)) == [1, 0]


def test_rank_neighbours_and_eligibility() -> None:
    """A group near an eligible match gets a share of its score, less the farther it is
    and more after the match (the reply) than before; ineligible groups never rank, nor
    lend their score to neighbours."""
    texts = ["before", "alpha", "zebra crossing", "reply", "gamma", "delta"]
    conv = conv_of(texts)
    idx = fill.index_history(conv, 6, texts.__getitem__)
    scores = fill.bm25(idx, fill.terms("zebra"), range(6))
    assert list(scores) == [2]
    assert fill.rank(idx, "zebra", range(6)) == [2, 3, 4, 1, 0, 5]  # 4 and 1 tie: newer
    assert fill.rank(idx, "zebra", {0, 1, 2, 4, 5}) == [2, 4, 1, 0, 5]
    assert fill.rank(idx, "zebra", {0, 1, 3, 4}) == []


def test_cjk_bigrams_and_stems_match() -> None:
    """Chinese matches by bigrams (the store's index words), English by a light stem."""
    texts = ["预算10万的方案", "无关的内容", "she researched adoption agencies"]
    conv = conv_of(texts)
    idx = fill.index_history(conv, 3, texts.__getitem__)
    assert fill.rank(idx, "预算是多少", {0, 1, 3})[0] == 0
    assert fill.rank(idx, "What did she research?", {1, 2})[0] == 2
    assert fill.terms("Researching agencies") == ["research", "agenci"]


def test_index_resumes_where_the_history_grew() -> None:
    """The index in the memo is extended, not rebuilt, while the groups are the same
    objects; another list of groups (an edited history) rebuilds it."""
    texts = ["one apple", "two pears", "three plums"]
    conv = conv_of(texts)
    read: list[int] = []

    def text_of(i: int) -> str:
        read.append(i)
        return texts[i]

    fill.index_history(conv, 2, text_of)
    assert read == [0, 1]
    idx = fill.index_history(conv, 3, text_of)
    assert read == [0, 1, 2] and idx.n == 3 and idx.words[2] == {"three": 1, "plum": 1}
    edited = conv_of(texts)
    edited.memo = conv.memo
    fill.index_history(edited, 3, text_of)
    assert read == [0, 1, 2, 0, 1, 2]


def test_forward_order_moves_recalled_after_the_stable_part() -> None:
    """System and kept history as they were, the recalled groups, then the current turn."""
    assert fill.forward_order((0, 1, 2, 7, 8, 9), (1, 2), 9) == [0, 7, 8, 1, 2, 9]
    assert fill.forward_order((0, 5, 6), (), 6) == [0, 5, 6]


def chat_rules(share: float, budget: int = 400, **eviction: Any) -> Rules:
    return build_rules({
        "memory": {"enable_eviction": True,
                   "budget": {"max_tokens": budget, "max_chars": None, "max_messages": None,
                              "max_turns": None},
                   "eviction": {"recall_share": share, **eviction}},
        "tokens": {"models_file": "rules/models.yaml"}}, base_dir=ROOT)


def floor_tokens(d: Decision) -> int:
    """What a chat history's floor costs: the tool schemas and priming, the system message
    (the first) and the current turn (the last message), counted apart from the plan."""
    return d.overhead_tokens() + d.message_tokens(0) + d.message_tokens(len(d.messages) - 1)


def history_tokens(d: Decision) -> int:
    """The forwarded request's tokens on top of the floor: what the budget counts."""
    return d.kept_tokens() - floor_tokens(d)


def long_chat(question: str) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for t in range(40):
        fact = ("My sister's cat is called Marmalade." if t == 3
                else f"Day {t}: we talked about the weather and the garden again.")
        msgs += [{"role": "user", "content": fact},
                 {"role": "assistant", "content": f"Noted, day {t}. Anything else today?"}]
    msgs.append({"role": "user", "content": question})
    return msgs


def test_plan_recalls_the_relevant_dropped_turn_within_budget() -> None:
    """The early turn the question is about comes back (with its reply as a neighbour),
    forwarded after the stable part and before the question; within the budget."""
    msgs = long_chat("What is the name of my sister's cat?")
    raw = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs})
    off = decide(raw, orjson.loads(raw), chat_rules(0.0), TOK)
    on = decide(raw, orjson.loads(raw), chat_rules(0.5), TOK)
    assert off.plan is not None and on.plan is not None
    assert 7 not in off.plan.kept and off.plan.recalled == ()
    assert 7 in on.plan.recalled and 7 in on.plan.kept
    assert on.plan.recalled_tokens == sum(on.message_tokens(i) for i in on.plan.recalled)
    assert not on.plan.over_budget and history_tokens(on) <= 400
    out = orjson.loads(on.forward)["messages"]
    assert out[-1] == msgs[-1] and out[0] == msgs[0]
    j = out.index(msgs[7])
    assert all(m in msgs[1:7] or m in msgs[7:] for m in out[1:])
    stable = [m for m in out[1:j] if msgs.index(m) > 7]
    assert stable and all(msgs.index(a) < msgs.index(b) for a, b in pairwise(stable))
    # planning what was forwarded again drops nothing
    again = orjson.dumps({"model": "gpt-4o-mini", "messages": out})
    redo = decide(again, orjson.loads(again), chat_rules(0.5), TOK)
    assert redo.plan is not None and not redo.plan.dropped


def test_no_fill_when_nothing_is_dropped_openers_when_nothing_matches() -> None:
    """A history that fits is forwarded as is; a question sharing no word with the history
    brings back only dropped turns' opening user messages, newest first."""
    short = long_chat("cat?")[:5] + [{"role": "user", "content": "cat?"}]
    raw = orjson.dumps({"model": "gpt-4o-mini", "messages": short})
    d = decide(raw, orjson.loads(raw), chat_rules(0.5), TOK)
    assert d.plan is not None and not d.plan.dropped and d.plan.recalled == ()
    msgs = long_chat("Zyxwv?")
    raw = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs})
    d = decide(raw, orjson.loads(raw), chat_rules(0.5), TOK)
    assert d.plan is not None and d.plan.dropped and d.plan.recalled
    assert all(msgs[i]["role"] == "user" for i in d.plan.recalled)
    dropped_users = [i for i, _ in d.plan.dropped if msgs[i]["role"] == "user"]
    assert max(d.plan.recalled) > max(dropped_users)  # the newest went first


def agent_loop(turns: int, question: str) -> list[dict[str, Any]]:
    """An agent's history: each turn a short request, a tool call, a long result that
    shares words with the question (a log search), and the answer."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You operate the shop."}]
    for t in range(turns):
        lines = [f"2026-11-{t + 1:02d} order {t}-{k} payment timeout retry refund"
                 for k in range(40)]
        msgs += [{"role": "user", "content": f"Task {t}: look into ticket T-{900 + t}."},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"call_{t}", "type": "function",
                      "function": {"name": "search_logs", "arguments": f'{{"day": {t + 1}}}'}}]},
                 {"role": "tool", "tool_call_id": f"call_{t}", "content": "\n".join(lines)},
                 {"role": "assistant", "content": f"Ticket T-{900 + t} checked."}]
    msgs.append({"role": "user", "content": question})
    return msgs


def test_fill_brings_back_what_each_tool_turn_was_asked_first() -> None:
    """The results match the question's words and would fill the room; the short
    request that opened each dropped tool turn comes back first (newest first, in at
    most 3/4 of the room), so the model still sees what it was asked. Before, the
    ranked results took the room and two of the eight requests stayed dropped (checked
    against that order)."""
    msgs = agent_loop(8, "Which orders had a payment timeout and were refunded?")
    raw = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs})
    d = decide(raw, orjson.loads(raw), chat_rules(0.4, budget=1500), TOK)
    assert d.plan is not None and d.plan.dropped and not d.plan.over_budget
    assert history_tokens(d) <= 1500
    out = orjson.loads(d.forward)["messages"]
    requests = [m for m in msgs[:-1] if m["role"] == "user"]
    assert all(m in out for m in requests), [m["content"] for m in requests if m not in out]
    assert any(msgs[i]["role"] == "tool" for i in d.plan.recalled)  # the ranking still runs
    # pairs stay whole
    calls = {c["id"] for m in out if m.get("tool_calls") for c in m["tool_calls"]}
    assert calls == {m["tool_call_id"] for m in out if m["role"] == "tool"}
    # a chat (no tool turns) is ranked as before: the openings come after the ranked turns
    chat = long_chat("What is the name of my sister's cat?")
    raw = orjson.dumps({"model": "gpt-4o-mini", "messages": chat})
    on = decide(raw, orjson.loads(raw), chat_rules(0.5), TOK)
    assert on.plan is not None and 7 in on.plan.recalled


async def test_http_dropped_relevant_turn_comes_back(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """Through the gateway (OpenAI SDK as the caller): the dropped turn the question is
    about is in the forwarded body, and the [mem] line says what was recalled."""
    gw = await gateway(memory={"enable_eviction": True,
                               "budget": {"max_tokens": 400, "max_chars": None,
                                          "max_messages": None, "max_turns": None},
                               "eviction": {"recall_share": 0.5}})
    client = AsyncOpenAI(base_url=str(gw.server.make_url("/v1")), api_key="sk-test")
    msgs = long_chat("What is the name of my sister's cat?")
    await client.chat.completions.create(model="gpt-4o-mini", messages=msgs)  # type: ignore[arg-type]
    await client.close()
    fwd = upstream.last_body()["messages"]
    assert msgs[7] in fwd and len(fwd) < len(msgs)
    assert fwd[-1] == msgs[-1]
    ev = (await gw.wait_mem(1))[-1]
    assert int(ev["recalled"]) >= 1 and int(ev["recalled_tokens"]) > 0
    assert int(ev["kept"]) == len(fwd)


WORDS = ["rex", "puppy", "weather", "budget", "the", "what", "预算", "方案", "alpha", "zebra"]


@given(texts=st.lists(st.lists(st.sampled_from(WORDS), max_size=6).map(" ".join),
                      min_size=1, max_size=30),
       query=st.lists(st.sampled_from(WORDS), min_size=1, max_size=5).map(" ".join),
       cut=st.integers(0, 30), data=st.data())
@settings(max_examples=60, deadline=None)
def test_index_grown_request_by_request_scores_as_one_built_at_once(
        texts: list[str], query: str, cut: int, data: st.DataObject) -> None:
    """The session's index, extended as the history grows, gives the same scores as an
    index of the whole history built at once, and both as Okapi BM25 written out (idf
    squared) over every group; rank returns each eligible group once, nothing else."""
    n, cut = len(texts), min(cut, len(texts))
    grown = conv_of(texts)
    fill.index_history(grown, cut, texts.__getitem__)
    idx = fill.index_history(grown, n, texts.__getitem__)
    fresh = fill.index_history(conv_of(texts), n, texts.__getitem__)
    eligible = set(data.draw(st.lists(st.integers(0, n - 1), max_size=n)))
    q = fill.query_terms(query)
    assert fill.bm25(idx, q, eligible) == fill.bm25(fresh, q, eligible)
    words = [Counter(fill.terms(t)) for t in texts]
    avg = sum(map(len, (fill.terms(t) for t in texts))) / n or 1.0
    expect: dict[int, float] = {}
    for term in q:
        df = sum(term in w for w in words)
        for g in sorted(eligible):
            tf = words[g][term]
            if tf:
                idf = math.log(1.0 + (n - df + 0.5) / (df + 0.5)) ** fill.IDF_POWER
                norm = fill.K1 * (1.0 - fill.B + fill.B * sum(words[g].values()) / avg)
                expect[g] = expect.get(g, 0.0) + idf * tf * (fill.K1 + 1.0) / (tf + norm)
    got = fill.bm25(idx, q, eligible)
    assert got.keys() == expect.keys()
    assert all(math.isclose(got[g], expect[g]) for g in got)
    ranked = fill.rank(idx, query, eligible)
    assert len(ranked) == len(set(ranked)) and set(ranked) <= eligible


def capped(share: float, max_turns: int | None = None, max_messages: int | None = None,
           max_chars: int | None = None, max_tokens: int = 400) -> Rules:
    return build_rules({
        "memory": {"enable_eviction": True,
                   "budget": {"max_tokens": max_tokens, "max_chars": max_chars,
                              "max_messages": max_messages, "max_turns": max_turns},
                   "eviction": {"recall_share": share}},
        "tokens": {"models_file": "rules/models.yaml"}}, base_dir=ROOT)


def turns_of(kept: list[int] | tuple[int, ...]) -> int:
    """The turns of long_chat's messages (system at 0, then user, assistant per turn)."""
    return len({(i + 1) // 2 for i in kept if i})


def test_turn_cap_counts_recalled_turns_and_leaves_them_the_share() -> None:
    """max_turns bounds every forwarded turn (stable, recalled, current); the stable part
    gets int((1 - recall_share) * max_turns) of them, the fill the rest: at each cap the
    turn asked about comes back while one turn is left, and never past the cap."""
    msgs = long_chat("What is the name of my sister's cat?")
    raw = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs})
    for share in (0.3, 0.5):
        for cap in range(1, 24):
            d = decide(raw, orjson.loads(raw), capped(share, max_turns=cap, max_tokens=6000),
                       TOK)
            assert d.plan is not None
            stable = [i for i, why in zip(d.plan.kept, d.plan.kept_by)
                      if why not in ("system", "recalled")]
            room = max(1, int(cap * (1 - share)))
            assert turns_of(stable) <= room
            assert turns_of(d.plan.kept) <= cap, (share, cap)
            assert (7 in d.plan.recalled) == (room < cap), (share, cap)
            if cap >= 4:  # every turn left to the fill is used
                assert turns_of(d.plan.kept) == cap


def test_message_and_char_caps_count_recalled_messages() -> None:
    """max_messages and max_chars bound the whole forwarded history too, recalled part
    included, with the stable part under (1 - recall_share) of each."""
    msgs = long_chat("What is the name of my sister's cat?")
    raw = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs})
    chars = [len(m["content"]) for m in msgs]
    for cap in range(3, 40):
        d = decide(raw, orjson.loads(raw), capped(0.3, max_messages=cap, max_tokens=6000), TOK)
        assert d.plan is not None
        stable = [i for i, why in zip(d.plan.kept, d.plan.kept_by) if why != "recalled"]
        assert len(stable) <= max(1, int(cap * 0.7)) + 1  # + the system message (fixed)
        assert len(d.plan.kept) <= cap and not d.plan.over_budget
        if cap >= 8:
            assert 7 in d.plan.recalled
    for cap in range(300, 2400, 150):
        d = decide(raw, orjson.loads(raw), capped(0.3, max_chars=cap, max_tokens=6000), TOK)
        assert d.plan is not None and not d.plan.over_budget
        assert sum(chars[i] for i in d.plan.kept) - chars[0] - chars[-1] <= cap
        assert 7 in d.plan.recalled


async def test_http_shipped_caps_recall_within_every_cap(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """Through the gateway with the shipped caps (20 turns, 60 messages, 24,000 characters,
    the conftest's budget): a 40-turn chat forwards at most 20 turns and 60 messages and
    still brings back the turn the question is about; the [mem] line says so."""
    gw = await gateway(memory={"enable_eviction": True, "eviction": {"recall_share": 0.3}})
    client = AsyncOpenAI(base_url=str(gw.server.make_url("/v1")), api_key="sk-test")
    msgs = long_chat("What is the name of my sister's cat?")
    await client.chat.completions.create(model="gpt-4o-mini", messages=msgs)  # type: ignore[arg-type]
    await client.close()
    fwd = upstream.last_body()["messages"]
    assert msgs[7] in fwd and fwd[-1] == msgs[-1]
    assert turns_of([msgs.index(m) for m in fwd]) <= 20 and len(fwd) <= 60
    ev = (await gw.wait_mem(1))[-1]
    assert int(ev["recalled"]) >= 1 and int(ev["kept"]) == len(fwd)


CHAT_WORDS = ["cat", "garden", "weather", "sister", "Marmalade", "budget", "预算", "trip"]


@pytest.mark.slow
@given(turns=st.lists(st.lists(st.sampled_from(CHAT_WORDS), min_size=1, max_size=12),
                      min_size=2, max_size=24),
       question=st.lists(st.sampled_from(CHAT_WORDS), min_size=1, max_size=3),
       share=st.sampled_from([0.1, 0.3, 0.5]),
       binding=st.sets(st.sampled_from(["turns", "messages", "chars", "tokens"]), min_size=1),
       limit=st.integers(1, 40))
@settings(max_examples=150, deadline=None)
def test_every_cap_bounds_the_forward_and_the_stable_part_its_share(
        turns: list[list[str]], question: list[str], share: float, binding: set[str],
        limit: int) -> None:
    """Whatever the caps and the share: a plan within the floor forwards at most max_turns
    turns, max_messages messages, max_chars characters and max_tokens tokens, recalled
    history included; when the fill ran, the rest fits (1 - recall_share) of each."""
    max_turns = limit % 16 + 1 if "turns" in binding else None
    max_messages = limit if "messages" in binding else None
    max_chars = 20 + 35 * limit if "chars" in binding else None
    max_tokens = 30 + 20 * limit if "tokens" in binding else 6000
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for words in turns:
        msgs += [{"role": "user", "content": " ".join(words)},
                 {"role": "assistant", "content": "ok " + words[-1]}]
    msgs.append({"role": "user", "content": " ".join(question) + "?"})
    raw = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs})
    rules = capped(share, max_turns, max_messages, max_chars, max_tokens)
    d = decide(raw, orjson.loads(raw), rules, TOK)
    p = d.plan
    assert p is not None
    if p.over_budget:  # system + the current turn alone exceed a message or turn cap
        return
    chars = [len(m["content"]) for m in msgs]
    floor_chars = chars[0] + chars[-1]  # the token and character caps count on top of it

    def within(kept: list[int], part: float) -> bool:
        def cap(n: int | None) -> int | None:
            return None if n is None else max(1, int(n * part))
        t, m, c = cap(max_turns), cap(max_messages), cap(max_chars)
        return ((t is None or turns_of(kept) <= t) and (m is None or len(kept) <= m)
                and (c is None or sum(chars[i] for i in kept) - floor_chars <= c))

    assert within(list(p.kept), 1.0) and history_tokens(d) <= max_tokens
    if p.dropped or p.recalled:  # the fill ran: the stable part was planned under its share
        stable = [i for i, why in zip(p.kept, p.kept_by) if why != "recalled"]
        floor = [i for i, why in zip(p.kept, p.kept_by) if why in ("system", "current")]
        assert within(stable, 1.0 - share) or stable == floor  # the floor is always kept


# what the carry note keeps (paths, files, services, urls, asks, confirmations), {k} the
# turn: many turns, many lines of note
NOTE_TURNS = ["check /srv/data/orders{k}.csv for last week", "yes, write it to /tmp/r{k}.md",
              "should I export summary {k}?", "the billing-service logs are in /var/log/a{k}",
              "analyze that file", "done, saved to out{k}.json", "cat garden weather trip",
              "https://example.com/spec{k} has the schema"]


def shipped(**budget: Any) -> Rules:
    """rules/gateway.yaml (carry rules included), eviction on, these budget keys."""
    import yaml

    cfg = yaml.safe_load((ROOT / "rules" / "gateway.yaml").read_text(encoding="utf-8"))
    cfg["memory"]["enable_eviction"] = True
    cfg["memory"]["budget"].update(budget)
    return build_rules(cfg, base_dir=ROOT / "rules")


@pytest.mark.slow
@given(turns=st.lists(st.sampled_from(NOTE_TURNS), min_size=3, max_size=40),
       max_tokens=st.integers(60, 400),
       max_messages=st.none() | st.integers(4, 30),
       max_chars=st.none() | st.integers(400, 4000))
@settings(max_examples=120, deadline=None)
def test_the_carry_note_is_counted_into_every_budget(
        turns: list[str], max_tokens: int, max_messages: int | None,
        max_chars: int | None) -> None:
    """With the carry note the fill leaves room for: what is forwarded, the note
    included, is within max_tokens (the gateway's counts) and max_chars on top of the
    floor (system, the current turn), and within max_messages, unless over budget."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for k, text in enumerate(turns):
        msgs += [{"role": "user", "content": text.format(k=k)},
                 {"role": "assistant", "content": f"ok, {text.split()[-1]} noted"}]
    msgs.append({"role": "user", "content": "what about that file?"})
    raw = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs})
    rules = shipped(max_tokens=max_tokens, max_messages=max_messages, max_chars=max_chars)
    d = decide(raw, orjson.loads(raw), rules, TOK)
    assert d.plan is not None
    if d.plan.over_budget:
        return
    sent = orjson.loads(d.forward)["messages"]
    note = [m for m in sent if m["role"] == "system" and m["content"] == d.note]
    assert len(note) == (d.note is not None)
    tokens = d.overhead_tokens() + sum(d.wire.item_tokens(m, d.counter) for m in sent)
    assert tokens - floor_tokens(d) <= max_tokens
    assert max_messages is None or len(sent) <= max_messages
    floor_chars = len(msgs[0]["content"]) + len(msgs[-1]["content"])
    assert max_chars is None or sum(len(m["content"]) for m in sent) - floor_chars <= max_chars


def test_recall_leaves_messages_with_a_cache_breakpoint_dropped() -> None:
    """A dropped message carrying an Anthropic cache breakpoint is not recalled, not even
    as the opening of a recalled reply's turn: moved after the stable prefix, the client's
    1-hour breakpoint would follow its 5-minute one, which the API refuses (1h entries
    must come first). Nor is the rest of its turn (kept history starts each turn with
    its user message)."""
    from gateway.wire.anthropic_messages import ANTHROPIC_MESSAGES

    filler = " lorem ipsum dolor sit amet" * 60
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "My aquarium pump is the XK-42."
                                      + filler, "cache_control": {"type": "ephemeral",
                                                                  "ttl": "1h"}}]},
        {"role": "assistant", "content": "Noted: the zebrafish aquarium pump XK-42." + filler}]
    for t in range(8):
        msgs += [{"role": "user", "content": f"unrelated question {t}" + filler},
                 {"role": "assistant", "content": [{"type": "text",
                                                    "text": f"answer {t}" + filler}]}]
    msgs[-1]["content"][0]["cache_control"] = {"type": "ephemeral"}  # 5 minutes
    msgs.append({"role": "user", "content": "Which zebrafish aquarium pump did I mention?"})
    raw = orjson.dumps({"model": "claude-sonnet-4-5", "max_tokens": 1024, "messages": msgs})
    d = decide(raw, orjson.loads(raw), shipped(max_tokens=2500), TOK, ANTHROPIC_MESSAGES)
    assert d.plan is not None and d.plan.dropped
    out = orjson.loads(d.forward)["messages"]
    ttls = [b["cache_control"].get("ttl", "5m") for m in out if isinstance(m["content"], list)
            for b in m["content"] if "cache_control" in b]
    assert ttls == ["5m"], ttls
    assert 0 not in d.plan.kept and 1 not in d.plan.kept


@pytest.mark.slow
@given(dfs=st.lists(st.integers(1, 12), min_size=1, max_size=8),
       per_term=st.integers(1, 6), in_all=st.integers(1, 30),
       below=st.none() | st.integers(0, 41), data=st.data())
@settings(max_examples=200, deadline=None)
def test_scoring_reads_the_rarest_terms_newest_groups_within_its_bounds(
        dfs: list[int], per_term: int, in_all: int, below: int | None,
        data: st.DataObject) -> None:
    """What one request's scoring reads is bounded per term and in all, whatever the
    history: of each term's groups before `below` (where the candidates end), the
    newest, the rarest terms' first, and nothing is left out while the bounds are not
    reached."""
    postings = {f"t{k}": sorted(data.draw(st.sets(st.integers(0, 40), min_size=df,
                                                  max_size=df)))
                for k, df in enumerate(dfs)}
    query = data.draw(st.permutations([*postings, "absent"]))
    got = fill._read(postings, query, per_term, in_all, below)
    end = 41 if below is None else below
    readable = {t: [g for g in h if g < end] for t, h in postings.items()}
    want = {t: min(len(h), per_term) for t, h in readable.items()}
    read = {t: hits for t, _, hits in got}
    assert [t for t, _, _ in got] == [t for t in query if t in read]  # query order
    assert all(df == len(postings[t]) for t, df, _ in got)
    assert all(hits and hits == readable[t][len(readable[t]) - len(hits):]  # newest
               and len(hits) <= per_term for t, hits in read.items())
    assert sum(map(len, read.values())) == min(in_all, sum(want.values()))
    # rarest first (ties: in query order): before a term that reads less than it could,
    # every term reads all it could; after it, none reads anything
    order = sorted(postings, key=lambda t: (len(postings[t]), query.index(t)))
    short = [k for k, t in enumerate(order) if len(read.get(t, ())) < want[t]]
    if short:
        assert all(len(read.get(t, ())) == want[t] for t in order[:short[0]])
        assert not any(t in read for t in order[short[0] + 1:])


def test_a_query_of_common_words_reads_a_bounded_share_of_a_repetitive_history() -> None:
    """A history that repeats a few words (a log, a template): scoring reads MAX_READ
    postings, the rare word's group is still found first."""
    texts = [f"retry timeout pool acquire handler worker queue line {k}" for k in range(400)]
    texts[17] += " zebra"
    idx = fill.index_history(conv_of(texts), len(texts), texts.__getitem__)
    q = fill.query_terms("retry timeout pool acquire handler worker queue zebra")
    reads = fill._read(idx.postings, q)
    assert sum(len(h) for _, _, h in reads) == fill.MAX_READ < len(q) * fill.MAX_POSTINGS
    assert reads[-1][0] == "zebra" and reads[-1][2] == [17]  # the rarest is read
    assert fill.rank(idx, " ".join(q), range(len(texts)))[0] == 17


def test_scoring_spends_its_bound_on_candidates_not_on_kept_groups() -> None:
    """The newest groups are the kept ones: a question's common words there do not use
    up what scoring reads before it gets to the old group that answers it."""
    texts = [f"note {k}" for k in range(400)]
    for k in range(300, 400):
        texts[k] += " deploy cluster invoice"
    texts[10] += " invoice"
    idx = fill.index_history(conv_of(texts), len(texts), texts.__getitem__)
    dropped = set(range(200))
    assert fill.rank(idx, "deploy cluster invoice", dropped, below=200)[0] == 10
    # every term's newest groups, capped in all: the old group is not read
    assert 10 not in fill.bm25(idx, ["deploy", "cluster", "invoice"], dropped)
