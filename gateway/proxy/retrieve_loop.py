"""The retrieval loop: memgate answers its own retrieval tool (memory.retrieve).

A forwarded body that carries the tool (decide.retrieve) is relayed here. Its answer is
read as it comes: an answer that does not call the tool goes to the client unchanged
(streamed as it arrives, or whole). When the model calls only the retrieval tool, memgate
answers each call from the request in hand (the client's body holds what the cut left
out) or from the tenant's archive (a record of the same session), appends the call and
its result, and asks the upstream again, up to `max_rounds` times; the last round is
asked with tool_choice none, so the model answers. The client gets one answer made of
every round (wire.answers): no retrieval call in it, usage the sum of every round.

Decided here:
- the model calls the retrieval tool together with the client's own tools: the client
  gets its tools' calls (ours taken out) and runs them; the next request carries the
  markers again, so the model can retrieve then;
- a round that fails (no answer, an error status, a broken stream, a timeout of the
  upstream's own read timeout): the client gets what the rounds before it answered,
  ended as a plain end of turn, and the [mem] line says retrieve_error;
- the rounds are read uncompressed (Accept-Encoding: identity upstream).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from gateway.config.schema import Rules, Upstream
from gateway.decide.decision import Decision
from gateway.decide.retrieve import page, passages, resolve
from gateway.errors import GatewayError
from gateway.observe.relayed import Relayed
from gateway.observe.usage import reader_for
from gateway.proxy.upstream import (
    StreamEnd,
    UpstreamPool,
    answer_headers,
    pass_on,
    send,
    upstream_headers,
)
from gateway.wire.answers import Answers, Call, Round
from gateway.wire.answers_by_wire import ANSWERS
from gateway.wire.retrieve_tool import next_body

MAX_ANSWER_BYTES = 32 << 20  # of one non-streaming round read whole
MAX_CALLS = 8  # retrieval calls answered in one round (the rest are told to call again)
# what reading an upstream answer of an unexpected shape raises
UNREADABLE = (orjson.JSONDecodeError, TypeError, ValueError, KeyError, IndexError,
              AttributeError)
# the store's record of a handle: (tenant, session, handle) -> its text, or None
Archived = Callable[[str], Awaitable[str | None]]


class RoundFailed(Exception):
    """A retrieval round the upstream did not answer with a usable answer."""


@dataclass
class Loop:
    """One client request's rounds."""

    request: web.Request
    pool: UpstreamPool
    up: Upstream
    rules: Rules
    d: Decision
    info: Relayed
    archived: Archived | None  # the tenant's archive, this session's records
    extra_headers: dict[str, str] | None = None

    def __post_init__(self) -> None:
        self.answers: Answers = ANSWERS[self.d.wire.name]
        self.tool = self.d.retrieve or ""
        self.limit = self.rules.memory.retrieve.max_rounds
        self.rounds = 0

    async def answer(self, call: Call) -> str:
        """memgate's result for one retrieval call."""
        try:
            args = orjson.loads(call.arguments or "{}")
        except orjson.JSONDecodeError:
            args = None
        handle = args.get("handle") if isinstance(args, dict) else None
        offset = args.get("offset", 0) if isinstance(args, dict) else 0
        if not isinstance(handle, str) or not handle:
            return f'[memgate: {self.tool} takes {{"handle": "<the handle a marker names>"}}]'
        query = args.get("query") if isinstance(args, dict) else None
        if not isinstance(offset, int) or isinstance(offset, bool):
            offset = 0
        text = resolve(self.d, handle)
        if text is None and self.archived is not None:
            text = await self.archived(handle)
        if text is None:
            return f"[memgate: nothing is kept under the handle {handle!r} in this conversation]"
        if isinstance(query, str) and query.strip():
            text = passages(text, query)
        return page(text, offset, self.rules.memory.retrieve.max_result_chars, self.tool)

    async def next_round(self, sent: dict[str, Any], rnd: Round
                         ) -> tuple[dict[str, Any], aiohttp.ClientResponse]:
        """Answer the round's calls and ask the upstream again: (the body sent, the
        upstream's answer, status 200). Raises RoundFailed."""
        self.rounds += 1
        results = [(c.id, await self.answer(c)) for c in rnd.ours[:MAX_CALLS]]
        results += [(c.id, f"[memgate: at most {MAX_CALLS} {self.tool} calls are answered at "
                           "once; call again for this one]") for c in rnd.ours[MAX_CALLS:]]
        body = next_body(self.d.wire, sent, rnd.turn, results, self.rounds >= self.limit)
        headers = upstream_headers(self.request, self.up, self.rules.tenants.credential_headers,
                                   self.extra_headers)
        headers["Accept-Encoding"] = "identity"
        t0 = time.perf_counter()
        try:
            resp = await send(self.request, self.pool, self.up, body, Relayed(), headers)
        except GatewayError as exc:
            raise RoundFailed(exc.code) from None
        finally:
            self.info.retrieve_ms += (time.perf_counter() - t0) * 1000
        if resp.status != 200:
            resp.close()
            raise RoundFailed(f"status_{resp.status}")
        return orjson.loads(body), resp

    def count(self, usage: dict[str, int] | None) -> None:
        """A retrieval round's own tokens, for the [mem] line (`input` counts the
        cached prompt tokens already: usage.normalise)."""
        if usage:
            self.info.retrieve_in += usage.get("input", 0)
            self.info.retrieve_out += usage.get("output", 0)


async def relay_retrieving(
    request: web.Request, pool: UpstreamPool, up: Upstream, rules: Rules, d: Decision,
    info: Relayed, original: bytes | None, on_sent: Callable[[], None] | None,
    archived: Archived | None, extra_headers: dict[str, str] | None = None,
) -> web.StreamResponse:
    """Forward `d.forward`, which carries the retrieval tool, and answer its calls
    (`extra_headers`: the trace context, on every round)."""
    wire = d.wire
    headers = upstream_headers(request, up, rules.tenants.credential_headers, extra_headers)
    headers["Accept-Encoding"] = "identity"  # the answer is read here
    t0 = time.perf_counter()
    up_resp = await send(request, pool, up, d.forward, info, headers, original, on_sent)
    info.upstream_ms = (time.perf_counter() - t0) * 1000
    info.status = up_resp.status
    ctype = up_resp.content_type
    if info.first_status or up_resp.status != 200 or ctype not in (
            "text/event-stream", "application/json"):
        # an error, or the client's own body resent (it carries no tool)
        return await pass_on(request, up_resp, info, wire.stream_ends, wire.name)
    loop = Loop(request, pool, up, rules, d, info, archived, extra_headers)
    if ctype == "text/event-stream":
        return await _streamed(loop, up_resp)
    return await _whole(loop, up_resp)


async def _read(resp: aiohttp.ClientResponse) -> bytes | None:
    """A whole answer, up to MAX_ANSWER_BYTES (None: longer, or broken off)."""
    parts, got = [], 0
    try:
        async with resp:
            async for chunk in resp.content.iter_any():
                got += len(chunk)
                if got > MAX_ANSWER_BYTES:
                    return None
                parts.append(chunk)
    except (TimeoutError, aiohttp.ClientError, OSError):
        return None
    return b"".join(parts)


async def _whole(loop: Loop, up_resp: aiohttp.ClientResponse) -> web.StreamResponse:
    """A non-streaming answer: read whole, the rounds run, one answer written."""
    request, info, d = loop.request, loop.info, loop.d
    resp = answer_headers(up_resp)
    resp.headers.popall("Content-Length", None)
    resp.headers.popall("Content-Encoding", None)
    raw = await _read(up_resp)
    if raw is None:
        info.stream = "upstream_aborted"
        if request.transport is not None:
            request.transport.close()
        return resp
    if loop.tool.encode() not in raw:  # no call of it (most answers): relayed as it came
        return await _write(request, resp, raw, info, d.wire.name)
    try:
        answer = orjson.loads(raw)
        rnd = loop.answers.read(answer, loop.tool) if isinstance(answer, dict) else None
    except UNREADABLE:
        rnd = None
    if rnd is None or not rnd.ours:
        return await _write(request, resp, raw, info, d.wire.name)
    rounds, sent = [answer], orjson.loads(d.forward)
    while rnd.ours and not rnd.others and loop.rounds < loop.limit:
        try:
            sent, nxt = await loop.next_round(sent, rnd)
            body = await _read(nxt)
            if body is None:
                raise RoundFailed("broken_answer")
            answer = orjson.loads(body)
            if not _an_answer(d.wire.name, answer):  # an error object answered 200
                raise RoundFailed("unreadable")
            got = loop.answers.read(answer, loop.tool)
            loop.answers.merge([*rounds, answer], loop.tool)  # one the merge cannot read
        except RoundFailed as exc:  # is a failed round, not a 500 after the rounds
            info.retrieve_error = str(exc)
            break
        except UNREADABLE:
            info.retrieve_error = "unreadable"
            break
        rnd = got
        usage = reader_for(d.wire.name, 200, nxt.headers)
        if usage is not None:
            usage.feed(body)
            loop.count(usage.result())
        rounds.append(answer)
    info.retrieve_rounds = loop.rounds
    merged = loop.answers.merge(rounds, loop.tool, end=bool(rnd.ours) and not rnd.others)
    return await _write(request, resp, orjson.dumps(merged), info, d.wire.name)


def _an_answer(wire: str, answer: Any) -> bool:
    """Is this JSON an answer of the wire (not an error object some routers send as a
    200)?"""
    if not isinstance(answer, dict):
        return False
    if wire == "anthropic_messages":
        return answer.get("type") == "message" and isinstance(answer.get("content"), list)
    if wire == "openai_responses":
        return isinstance(answer.get("output"), list)
    choices = answer.get("choices")
    return isinstance(choices, list) and bool(choices)


async def _write(request: web.Request, resp: web.StreamResponse, body: bytes, info: Relayed,
                 wire: str) -> web.StreamResponse:
    """The client's whole answer, its usage read for the [mem] line."""
    resp.content_length = len(body)
    usage = reader_for(wire, 200, resp.headers)
    if usage is not None:
        usage.feed(body)
        info.usage = usage.result()
        info.response_model, info.response_id = usage.model, usage.id
    try:
        await resp.prepare(request)
        await resp.write(body)
        await resp.write_eof()
        info.bytes_out += len(body)
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        info.client_left()
    return resp


class _ClientGone(Exception):
    pass


async def _streamed(loop: Loop, up_resp: aiohttp.ClientResponse) -> web.StreamResponse:
    """A streamed answer: relayed as it comes through the merge, the rounds run in the
    same client stream."""
    request, info, d = loop.request, loop.info, loop.d
    merge = loop.answers.stream(loop.tool)
    resp = answer_headers(up_resp)
    resp.headers.popall("Content-Length", None)
    resp.headers.popall("Content-Encoding", None)
    end = StreamEnd(d.wire.stream_ends) if d.wire.stream_ends else None
    usage = reader_for(d.wire.name, 200, resp.headers)

    async def out(data: bytes) -> None:
        nonlocal end
        if not data:
            return
        info.bytes_out += len(data)
        try:
            await resp.write(data)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            raise _ClientGone from None
        if end is not None and end.seen(data):
            info.ended, end = True, None
        if usage is not None:
            usage.feed(data)

    async def pump(src: aiohttp.ClientResponse, counted: bool) -> bool:
        """One round's stream through the merge; False if it broke off."""
        own = reader_for(d.wire.name, 200, src.headers) if counted else None
        try:
            async with src:
                async for chunk in src.content.iter_any():
                    if own is not None:
                        own.feed(chunk)
                    await out(merge.feed(chunk))
        except (TimeoutError, aiohttp.ClientError, OSError, *UNREADABLE):
            return False  # (an event of a shape the merge cannot read: as broken off)
        finally:
            if own is not None:
                loop.count(own.result())
        return True

    try:
        try:
            await resp.prepare(request)
        except BaseException:
            up_resp.release()
            raise
        whole = await pump(up_resp, False)
        rnd = merge.round_end() if whole else None
        if not whole:
            info.stream = "upstream_aborted"
        sent = orjson.loads(d.forward) if rnd is not None else {}
        while rnd is not None:
            if rnd.others or loop.rounds >= loop.limit:
                await out(merge.finish(end=not rnd.others))
                break
            try:
                sent, nxt = await loop.next_round(sent, rnd)
                if nxt.content_type != "text/event-stream":
                    nxt.close()
                    raise RoundFailed("not_a_stream")
            except RoundFailed as exc:
                info.retrieve_error = str(exc)
                await out(merge.finish(end=True))
                break
            merge.next_round()
            if not await pump(nxt, True):
                info.retrieve_error = "broken_stream"
                # what went of the round cannot be ended well-formed: an end only if
                # none of it went (else cut, as an upstream that breaks off is)
                ending = merge.finish(end=True)
                if not ending:
                    info.stream = "upstream_aborted"
                await out(ending)
                break
            rnd = merge.round_end()
        else:
            if whole:  # an upstream's last event without its blank line
                await out(merge.finish())
        info.retrieve_rounds = loop.rounds
        if not info.ended and info.stream == "upstream_aborted":
            if request.transport is not None:  # cut for the client too, as in pass_on
                request.transport.close()
            return resp
        await resp.write_eof()
    except _ClientGone:
        info.client_left()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        info.client_left()
    finally:
        if usage is not None:
            info.usage = usage.result()
            info.response_model, info.response_id = usage.model, usage.id
    return resp
