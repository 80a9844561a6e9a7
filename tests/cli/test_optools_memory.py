"""`memgate memory`: delete, flags after the subcommand, help with the fields, the same
search results from the CLI and the HTTP API, scores that mean something."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.config.schema import StoreRules, TenantRules
from gateway.measure.terms import index_text, query_terms
from gateway.memory.session import tenant_of
from gateway.memory.store.model import RECORD_FIELDS, Record, StoreError, build_record, ranked
from gateway.memory.store.sqlite import SqliteStore
from tests.cli.test_optools_captures import cli
from tests.conftest import SECRET, GatewayFactory, Upstream

REC = {"memory_type": "turn", "agent_id": "agent-1", "session_id": "s1",
       "ts": "2026-11-29T10:00:00Z", "role": "user", "text": "the budget is 100k for proj-x",
       "tags": ["budget"]}
FLT = ["--session-id", "s1", "--time-from", "2026-11-29T00:00:00Z"]


async def test_delete_is_tenant_scoped_and_flags_go_anywhere(tmp_path: Path) -> None:
    """delete removes one record of the caller's tenant only (another key: exit 1, the record
    stays); --config / --api-key work before and after the subcommand; the help names the
    record fields with an example."""
    cfg = tmp_path / "g.yaml"
    cfg.write_text(f"store:\n  path: {tmp_path / 'm.db'}\n")
    (code, out, err), (_, helped, _) = await asyncio.gather(
        cli("memory", "--config", str(cfg), "--api-key", "k1", "write", json.dumps(REC)),
        cli("memory", "search", "--help"))
    assert code == 0, err
    mid = json.loads(out)["memory_id"]
    for needed in ("session_id (required)", "agent_id", "ts (required", "memory write '{",
                   "--agent-id", "score"):
        assert needed in helped, needed
    # after the subcommand; another tenant: not found, nothing deleted
    code, out, err = await cli("memory", "delete", mid, "--config", str(cfg), "--api-key", "k2")
    assert code == 1 and f"no memory {mid!r} for this key" in err
    assert await stored(tmp_path / "m.db", "k1", mid)
    code, out, err = await cli("memory", "--api-key", "k1", "delete", "--config", str(cfg), mid)
    assert code == 0 and json.loads(out) == {"deleted": True}
    assert not await stored(tmp_path / "m.db", "k1", mid)


async def stored(db: Path, key: str, memory_id: str) -> bool:
    """Does the tenant of `key` hold `memory_id` in the SQLite store at `db`?"""
    store = SqliteStore(str(db))
    await store.open()
    try:
        tenant = tenant_of({"Authorization": f"Bearer {key}"}, TenantRules())
        assert tenant is not None
        return await store.get(tenant, memory_id) is not None
    finally:
        await store.close()


async def test_cli_and_http_search_show_the_same_fields_and_scores(
    gateway: GatewayFactory, upstream: Upstream, tmp_path: Path
) -> None:
    """The CLI on the store, the CLI through --url and the HTTP API give the same results:
    every field (agent_id included) and a score of the query terms matched: one hit that
    holds every term scores 1.0 (FTS5's BM25 scored it 1e-6), half of them 0.5."""
    db = tmp_path / "m.db"
    cfg = tmp_path / "cli.yaml"
    cfg.write_text(f"store:\n  path: {db}\n")
    gw = await gateway(store={"path": str(db)})
    auth = {"Authorization": f"Bearer {SECRET}"}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{gw.url}/v1/memories", data=orjson.dumps(REC), headers=auth) as r:
            assert r.status == 201
            mid = (await r.json())["memory_id"]

        async def http(query: str) -> list[dict[str, Any]]:
            async with s.post(f"{gw.url}/v1/memories/search", headers=auth, data=orjson.dumps(
                    {"filter": {"session_id": "s1", "agent_id": "agent-1",
                                "time_from": "2026-11-29T00:00:00Z"}, "query": query})) as r:
                assert r.status == 200
                results: list[dict[str, Any]] = (await r.json())["results"]
                return results

        query = "budget proj"
        via_http = await http(query)
        (c1, local, e1), (c2, remote, e2), (c3, _, e3) = await asyncio.gather(
            cli("memory", "search", *FLT, "--agent-id", "agent-1", "--query", query,
                "--config", str(cfg), "--api-key", SECRET),
            cli("memory", "search", *FLT, "--agent-id", "agent-1", "--query", query,
                "--url", gw.url, "--api-key", SECRET),
            cli("memory", "delete", mid, "--url", gw.url, "--api-key", "sk-someone-else"))
        assert c1 == c2 == 0, e1 + e2
        assert json.loads(local) == via_http == json.loads(remote)
        assert [r["memory_id"] for r in via_http] == [mid] and via_http[0]["score"] == 1.0
        assert via_http[0]["agent_id"] == "agent-1" and via_http[0]["role"] == "user"
        assert (await http("budget weather"))[0]["score"] == 0.5
        assert c3 == 1 and "404" in e3  # another tenant's delete: nothing deleted
        code, out, err = await cli("memory", "delete", mid, "--url", gw.url, "--api-key", SECRET)
        assert code == 0 and json.loads(out) == {"deleted": True}
        assert await http("budget") == []


async def test_cli_refuses_an_unknown_field_in_one_line(
    gateway: GatewayFactory, tmp_path: Path
) -> None:
    """`memgate memory write` with a field the record does not have: one stderr line that
    names it and the accepted ones, exit 2, nothing written (the store or --url alike)."""
    db = tmp_path / "m.db"
    cfg = tmp_path / "cli.yaml"
    cfg.write_text(f"store:\n  path: {db}\n")
    gw = await gateway(store={"path": str(db)})
    typo = json.dumps({**REC, "sesion": "s2"})
    (c1, o1, e1), (c2, o2, e2) = await asyncio.gather(
        cli("memory", "write", typo, "--config", str(cfg), "--api-key", SECRET),
        cli("memory", "write", typo, "--url", gw.url, "--api-key", SECRET))
    assert (c1, o1, e1.count("\n")) == (2, "", 1), e1
    assert e1.startswith("memgate memory write: unknown field 'sesion' in a turn record; "
                         "accepted: memory_type, kind, memory_id, session_id, ")
    assert (c2, o2, e2.count("\n")) == (2, "", 1), e2
    assert e2.startswith("memgate memory write: the gateway answered 400: unknown field "
                         "'sesion' in a turn record; accepted: ")
    code, out, err = await cli("memory", "search", *FLT, "--config", str(cfg),
                               "--api-key", SECRET)
    assert code == 0 and json.loads(out) == [], err


ALL_FIELDS = sorted({k for fields in RECORD_FIELDS.values() for k in fields})


@pytest.mark.slow
@given(st.sampled_from(["turn", "message", "session"]), st.data())
def test_a_field_outside_its_kind_is_never_dropped_silently(kind: str, data: st.DataObject
                                                            ) -> None:
    """Any key a kind does not list (another kind's field, any other text) is refused by
    name (its first 256 characters as the param), before any other check of the record;
    the kind's own keys never are."""
    key = data.draw(st.one_of(st.sampled_from(ALL_FIELDS), st.text(min_size=1, max_size=300))
                    .filter(lambda k: k not in RECORD_FIELDS[kind]))
    body: dict[str, Any] = {"memory_type": kind, key: 1}
    with pytest.raises(StoreError) as caught:
        build_record(body, "t", StoreRules())
    assert caught.value.param == key[:256] and "unknown field" in caught.value.message
    assert caught.value.message.endswith("accepted: " + ", ".join(RECORD_FIELDS[kind]))
    for own in RECORD_FIELDS[kind]:
        try:
            build_record({"memory_type": kind, own: None}, "t", StoreRules())
        except StoreError as exc:
            assert "unknown field" not in exc.message, (kind, own)


def _rec(text: str, i: int, ts: int = 0) -> Record:
    return Record(memory_id=str(i), tenant="t", agent_id="", memory_type="message",
                  session_id="s", ts=ts, text=text, tags=[], fields={})


WORDS = st.sampled_from(["budget", "report", "csv", "预算", "订单", "weather", "plan", "x"])


@given(st.lists(st.tuples(st.lists(WORDS, min_size=1, max_size=6).map(" ".join),
                          st.integers(0, 3)), min_size=1, max_size=6),
       st.lists(WORDS, min_size=1, max_size=4).map(" ".join), st.integers(1, 6))
def test_scores_are_the_share_of_query_terms_best_first(
    texts: list[tuple[str, int]], query: str, top_k: int
) -> None:
    """Every score is in 0..1, is the share of the query's terms the text holds, and the
    first top_k results with any of them come best first, ties to the newer: never in
    the backend's order (FTS5's statistics are every tenant's); a hit holding none of
    them (found by a backend's own folding: FTS5's "cafe" for "café") is none."""
    hits = [(_rec(t, i, ts), float(-i)) for i, (t, ts) in enumerate(texts)]
    out = ranked(hits, query, top_k)
    terms = query_terms(query)
    some = [r for r, _ in hits if set(index_text(r.text).split()) & set(terms)]
    assert len(out) == min(top_k, len(some)) and all(score > 0 for _, score in out)
    assert {id(r) for r, _ in out} <= {id(r) for r, _ in hits}
    assert ranked(hits[::-1], query, top_k) == out  # the backend's order changes nothing
    for r, score in out:
        assert 0.0 <= score <= 1.0
        words = set(index_text(r.text).split())
        assert score == round(sum(t in words for t in terms) / len(terms), 4)
    assert [s for _, s in out] == sorted((s for _, s in out), reverse=True)
    for (r1, a), (r2, b) in zip(out, out[1:]):
        if a == b:  # a tie goes to the newer
            assert (r1.ts, -int(r1.memory_id)) >= (r2.ts, -int(r2.memory_id))
