"""OpenTelemetry: a GenAI span per proxied request, continued from the caller and handed
upstream, its memgate.* attributes the [mem] line's; metrics; OTLP/HTTP export."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway.config.rules import build_rules
from gateway.errors import RulesError
from gateway.observe.otel import Tracing
from gateway.observe.relayed import Relayed
from gateway.wire.openai_chat import OPENAI_CHAT
from tests.conftest import (
    ANTHROPIC_REPLY,
    CHAT_REPLY,
    SECRET,
    Gateway,
    GatewayFactory,
    Upstream,
    anthropic_events,
    responses_events,
    responses_object,
    sse_chunks,
)
from tests.proxy.test_azure import azure, routes  # noqa: F401 - the Azure stand-in fixture

ROOT = Path(__file__).resolve().parents[2]
CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
CALLER = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01", "tracestate": "vendor=abc"}
EVICT = {"enable_eviction": True,
         "budget": {"max_tokens": 900, "max_chars": None, "max_messages": None,
                    "max_turns": None}}
TEXT = "zebrafinch"  # in every message the client sends: never in a span
OFF = {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}


class Traced:
    """A gateway whose tracing (set up from its config) exports to memory."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.reader = InMemoryMetricReader()
        st = gw.state
        assert st.tracer is st.tracing is not None  # tracing.enabled: true took effect
        st.observers.remove(st.tracing.observe)
        st.tracing = st.tracer = Tracing(provider, MeterProvider(metric_readers=[self.reader]))
        st.observers.append(st.tracing.observe)

    async def spans(self, n: int) -> tuple[ReadableSpan, ...]:
        """The finished spans once there are n (a span ends after its [mem] line)."""
        for _ in range(500):
            got = self.exporter.get_finished_spans()
            if len(got) >= n:
                return got
            await asyncio.sleep(0.01)
        raise AssertionError(f"expected {n} spans, got {len(self.exporter.get_finished_spans())}")

    def mem(self) -> list[dict[str, Any]]:
        return [ev for ev in map(json.loads, self.gw.log.getvalue().splitlines())
                if ev.get("event") == "mem"]

    async def wait_mem(self, n: int) -> list[dict[str, Any]]:
        for _ in range(500):
            if len(self.mem()) >= n:
                break
            await asyncio.sleep(0.01)
        assert len(self.mem()) >= n
        return self.mem()

    def metric(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        if data is None:
            return []
        return [p for rm in data.resource_metrics for sm in rm.scope_metrics
                for m in sm.metrics if m.name == name for p in m.data.data_points]


async def traced(gateway: GatewayFactory, memory: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None, **top: Any) -> Traced:
    gw = await gateway(memory=memory, env={**OFF, **(env or {})}, fmt="json",
                       tracing={"enabled": True}, **top)
    return Traced(gw)


def parent_of(header: str) -> tuple[str, str, str]:
    """(trace id, parent span id, flags) of a traceparent header."""
    version, trace_id, span_id, flags = header.split("-")
    assert version == "00"
    return trace_id, span_id, flags


def check_span(span: ReadableSpan, ev: dict[str, Any], got: dict[str, Any], model: str,
               provider: str, api: str) -> None:
    """The span continues the caller's trace, names itself after the model, says what the
    [mem] line says, and is the parent of the traceparent the upstream received."""
    ctx, parent = span.get_span_context(), span.parent
    assert span.name == f"chat {model}" and span.kind is SpanKind.CLIENT
    assert parent is not None and parent.is_remote
    assert f"{parent.trace_id:032x}" == CALLER_TRACE and f"{parent.span_id:016x}" == CALLER_SPAN
    assert f"{ctx.trace_id:032x}" == CALLER_TRACE
    assert ctx.trace_state.get("vendor") == "abc"
    up_trace, up_parent, flags = parent_of(got["headers"]["traceparent"])
    assert (up_trace, up_parent, flags) == (CALLER_TRACE, f"{ctx.span_id:016x}", "01")
    assert got["headers"]["tracestate"] == "vendor=abc"
    a = dict(span.attributes or {})
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == a["gen_ai.system"] == provider
    assert a["gen_ai.request.model"] == model == ev["model"]
    assert a["server.address"] == "127.0.0.1" and isinstance(a["server.port"], int)
    assert a["http.response.status_code"] == ev["status"] == 200
    assert a["gen_ai.conversation.id"] == ev["session"]
    assert a["memgate.api"] == api
    assert "error.type" not in a and span.status.status_code is StatusCode.UNSET
    mirrored = {k[len("memgate."):]: v for k, v in a.items() if k.startswith("memgate.")}
    for k in ("evict", "kept", "dropped", "est_tokens", "mode", "overhead_ms", "cut", "req"):
        assert mirrored[k] == ev[k], k
    for k, v in mirrored.items():
        assert k == "api" or v == ev[k], k
    assert not any(TEXT in str(v) or SECRET in str(v) for v in a.values())


def history(turns: int = 12) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": f"[PIN] {TEXT} rules."}]
    for t in range(turns):
        msgs += [{"role": "user", "content": f"{TEXT} question {t} " + "words " * 60},
                 {"role": "assistant", "content": f"{TEXT} answer {t}"}]
    msgs.append({"role": "user", "content": f"{TEXT} and now?"})
    return msgs


async def test_chat_completions_spans(gateway: GatewayFactory, upstream: Upstream) -> None:
    """openai chat.completions, plain then streamed: one span each, child of the caller's
    traceparent, parent of the upstream's; memgate.* says what the [mem] line says."""
    t = await traced(gateway, EVICT)
    async with openai.AsyncOpenAI(base_url=f"{t.gw.url}/v1", api_key=SECRET,
                                  max_retries=0) as c:
        await c.chat.completions.create(model="gpt-4o-mini", messages=history(),  # type: ignore[arg-type]
                                        extra_headers=CALLER, max_tokens=50, temperature=0.2)
        stream = await c.chat.completions.create(
            model="gpt-4o-mini", messages=history(), stream=True,  # type: ignore[arg-type]
            extra_headers=CALLER)
        assert "".join([ch.choices[0].delta.content or "" async for ch in stream]) == \
            "Hello world"
    spans = await t.spans(2)
    evs = t.mem()
    for span, ev, got, streamed in zip(spans, evs, upstream.received, (False, True),
                                       strict=True):
        check_span(span, ev, got, "gpt-4o-mini", "openai", "openai_chat")
        a = dict(span.attributes or {})
        assert a.get("gen_ai.request.stream", False) is streamed
        assert a["memgate.dropped"] > 0  # eviction on: the span says what was cut
    first = dict(spans[0].attributes or {})
    assert first["gen_ai.request.max_tokens"] == 50 and first["gen_ai.request.temperature"] == 0.2


async def test_responses_spans(gateway: GatewayFactory, upstream: Upstream) -> None:
    """openai responses.create, plain then streamed: one span each, linked both ways."""
    t = await traced(gateway, EVICT)
    items = history()
    async with openai.AsyncOpenAI(base_url=f"{t.gw.url}/v1", api_key=SECRET,
                                  max_retries=0) as c:
        resp = await c.responses.create(model="gpt-4o-mini", input=items,  # type: ignore[arg-type]
                                        extra_headers=CALLER, max_output_tokens=64)
        assert resp.output_text == "Hello from responses"
        stream = await c.responses.create(model="gpt-4o-mini", input=items, stream=True,  # type: ignore[arg-type]
                                          extra_headers=CALLER)
        kinds = [event.type async for event in stream]
        assert kinds[-1] == "response.completed"
    spans = await t.spans(2)
    for span, ev, got in zip(spans, t.mem(), upstream.received, strict=True):
        check_span(span, ev, got, "gpt-4o-mini", "openai", "openai_responses")
    assert dict(spans[0].attributes or {})["gen_ai.request.max_tokens"] == 64


async def test_anthropic_messages_spans(gateway: GatewayFactory, upstream: Upstream) -> None:
    """anthropic messages.create and messages.stream: provider anthropic, linked both ways."""
    t = await traced(gateway, EVICT)
    model = "claude-3-5-haiku-20241022"
    async with anthropic.AsyncAnthropic(base_url=t.gw.url, api_key=SECRET, max_retries=0) as c:
        msg = await c.messages.create(model=model, max_tokens=100, messages=history(),  # type: ignore[arg-type]
                                      extra_headers=CALLER)
        assert msg.content[0].text == "Hello from Claude"  # type: ignore[union-attr]
        async with c.messages.stream(model=model, max_tokens=50, messages=history(),  # type: ignore[arg-type]
                                     extra_headers=CALLER) as stream:
            assert "".join([x async for x in stream.text_stream]).strip() == "Hello from Claude"
    spans = await t.spans(2)
    for span, ev, got in zip(spans, t.mem(), upstream.received, strict=True):
        check_span(span, ev, got, model, "anthropic", "anthropic_messages")
        assert dict(span.attributes or {})["gen_ai.request.max_tokens"] in (100, 50)


async def test_azure_deployment_span_in_shadow(
    gateway: GatewayFactory, upstream: Upstream, azure: Upstream  # noqa: F811
) -> None:
    """AzureOpenAI on a deployment route, eviction in shadow (forwarded before it is
    measured): provider azure.ai.openai, model from the deployment, linked both ways."""
    t = await traced(gateway, upstreams=routes(azure, upstream))
    client = openai.AsyncAzureOpenAI(azure_endpoint=t.gw.url, api_key=SECRET,
                                     api_version="2024-10-21", max_retries=0)
    async with client:
        await client.chat.completions.create(model="prod-4o", messages=history(3),  # type: ignore[arg-type]
                                             extra_headers=CALLER)
    (span,) = await t.spans(1)
    (ev,) = t.mem()
    a = dict(span.attributes or {})
    assert span.name == "chat prod-4o" and a["gen_ai.provider.name"] == "azure.ai.openai"
    assert a["memgate.mode"] == ev["mode"] == "shadow" and a["memgate.would_drop"] >= 0
    assert a["server.address"] == "127.0.0.1" and a["server.port"] == azure.server.port
    _, up_parent, _ = parent_of(azure.received[-1]["headers"]["traceparent"])
    assert up_parent == f"{span.get_span_context().span_id:016x}"
    assert span.parent is not None and f"{span.parent.span_id:016x}" == CALLER_SPAN


async def test_duration_metric_per_request(gateway: GatewayFactory, upstream: Upstream) -> None:
    """gen_ai.client.operation.duration: one observation per request, by provider and model."""
    t = await traced(gateway)
    async with openai.AsyncOpenAI(base_url=f"{t.gw.url}/v1", api_key=SECRET,
                                  max_retries=0) as c:
        for _ in range(3):
            await c.chat.completions.create(model="gpt-4o-mini", messages=history(2))  # type: ignore[arg-type]
    await t.spans(3)
    points = t.metric("gen_ai.client.operation.duration")
    assert [p.count for p in points] == [3]
    attrs = dict(points[0].attributes)
    assert attrs["gen_ai.provider.name"] == "openai"
    assert attrs["gen_ai.request.model"] == "gpt-4o-mini"
    assert attrs["server.address"] == "127.0.0.1" and "error.type" not in attrs
    assert 0 < points[0].sum < 10


async def test_usage_becomes_token_attributes_and_metric() -> None:
    """The provider's usage ([mem] usage_in/usage_out, else the relay's) sets
    gen_ai.usage.* and feeds gen_ai.client.token.usage by token type."""
    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(provider, MeterProvider(metric_readers=[reader]))
    for fields, usage in (({"usage_in": 120, "usage_out": 7}, None),
                          ({}, {"input": 30, "cached": 20, "output": 5})):
        info = Relayed(status=200, usage=usage)
        req = make_mocked_request("POST", "/v1/chat/completions")
        span = tracing.start(req, info, OPENAI_CHAT)
        tracing.observe({"model": "gpt-4o-mini", "status": 200, **fields}, None, info)

        async def accounting() -> None:
            return None

        await span.after(accounting())
    first, second = (dict(s.attributes or {}) for s in exporter.get_finished_spans())
    assert (first["gen_ai.usage.input_tokens"], first["gen_ai.usage.output_tokens"]) == (120, 7)
    assert (second["gen_ai.usage.input_tokens"], second["gen_ai.usage.output_tokens"]) == (30, 5)
    assert second["gen_ai.usage.cache_read.input_tokens"] == 20
    data = reader.get_metrics_data()
    assert data is not None
    sums = {dict(p.attributes)["gen_ai.token.type"]: p.sum
            for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
            if m.name == "gen_ai.client.token.usage" for p in m.data.data_points}
    assert sums == {"input": 150, "output": 12}


# what the snapshot upstream answers instead of the model asked for, and its answer ids
ANSWERED = {b'"gpt-4o-mini"': b'"gpt-4o-mini-2024-07-18"',
            b'"claude-3-5-haiku-20241022"': b'"claude-3-5-haiku-20241022-v2"'}


@pytest.fixture
async def snapshot(aiohttp_server: Any) -> str:
    """An upstream of all three wires answering a dated model (not the one asked for), with
    an answer id per wire and per JSON / stream; a chat stream without usage."""

    def dated(raw: bytes, ident: bytes, streamed: bool) -> bytes:
        for asked, answered in ANSWERED.items():
            raw = raw.replace(asked, answered)
        return raw.replace(ident, ident + (b"-sse" if streamed else b"-json"))

    def route(json_body: bytes, events: list[bytes], ident: bytes) -> Any:
        async def answer(request: web.Request) -> web.StreamResponse:
            if not (await request.json()).get("stream"):
                return web.Response(body=dated(json_body, ident, False),
                                    content_type="application/json")
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for event in events:
                await resp.write(dated(event, ident, True))
            await resp.write_eof()
            return resp
        return answer

    app = web.Application()
    app.router.add_post("/v1/chat/completions", route(
        json.dumps(CHAT_REPLY).encode(), sse_chunks(["Hel", "lo"]), b"chatcmpl-test"))
    app.router.add_post("/v1/responses", route(
        json.dumps(responses_object("Hi")).encode(), responses_events("Hi"), b"resp_test"))
    app.router.add_post("/v1/messages", route(
        json.dumps(ANTHROPIC_REPLY).encode(), anthropic_events("Hi"), b"msg_test"))
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


async def test_response_model_and_id_come_from_the_answer(
    gateway: GatewayFactory, snapshot: str
) -> None:
    """Each wire, JSON and streamed: gen_ai.response.model is the model the provider named
    in its answer (not the one asked for) and gen_ai.response.id the answer's id, read
    where the usage is (a chat stream without usage too); the metrics carry the model."""
    t = await traced(gateway, upstream_url=snapshot)
    msgs: Any = [{"role": "user", "content": "hi"}]
    claude = "claude-3-5-haiku-20241022"
    async with openai.AsyncOpenAI(base_url=f"{t.gw.url}/v1", api_key=SECRET,
                                  max_retries=0) as c:
        chat = await c.chat.completions.create(model="gpt-4o-mini", messages=msgs)
        assert chat.model == "gpt-4o-mini-2024-07-18"
        stream = await c.chat.completions.create(model="gpt-4o-mini", messages=msgs,
                                                 stream=True)
        assert [ch.id async for ch in stream][0] == "chatcmpl-test-sse"
        assert (await c.responses.create(model="gpt-4o-mini", input="hi")).id == \
            "resp_test-json"
        assert [e.type async for e in await c.responses.create(
            model="gpt-4o-mini", input="hi", stream=True)][-1] == "response.completed"
    async with anthropic.AsyncAnthropic(base_url=t.gw.url, api_key=SECRET, max_retries=0) as a:
        assert (await a.messages.create(model=claude, max_tokens=9, messages=msgs)).id == \
            "msg_test-json"
        async with a.messages.stream(model=claude, max_tokens=9, messages=msgs) as ms:
            assert (await ms.get_final_message()).model == f"{claude}-v2"
    spans = await t.spans(6)
    got = [(dict(sp.attributes or {}).get("gen_ai.request.model"),
            dict(sp.attributes or {}).get("gen_ai.response.model"),
            dict(sp.attributes or {}).get("gen_ai.response.id")) for sp in spans]
    dated, claude_v2 = "gpt-4o-mini-2024-07-18", f"{claude}-v2"
    assert got == [("gpt-4o-mini", dated, "chatcmpl-test-json"),
                   ("gpt-4o-mini", dated, "chatcmpl-test-sse"),
                   ("gpt-4o-mini", dated, "resp_test-json"),
                   ("gpt-4o-mini", dated, "resp_test-sse"),
                   (claude, claude_v2, "msg_test-json"),
                   (claude, claude_v2, "msg_test-sse")]
    points = t.metric("gen_ai.client.operation.duration")
    assert sorted((dict(p.attributes)["gen_ai.response.model"], p.count) for p in points) == [
        (claude_v2, 2), (dated, 4)]


async def test_failed_request_span_has_error_type(gateway: GatewayFactory) -> None:
    """An unreachable upstream: the client gets Anthropic's error shape, the span error.type
    502 and an ERROR status; the duration metric carries the error too."""
    t = await traced(gateway, upstream_url="http://127.0.0.1:9")
    async with anthropic.AsyncAnthropic(base_url=t.gw.url, api_key=SECRET, max_retries=0) as c:
        with pytest.raises(anthropic.APIStatusError) as caught:
            await c.messages.create(model="claude-3-5-haiku-20241022", max_tokens=10,
                                    messages=[{"role": "user", "content": "hi"}],
                                    extra_headers=CALLER)
    assert caught.value.status_code == 502 and caught.value.body["type"] == "error"  # type: ignore[index]
    (span,) = await t.spans(1)
    a = dict(span.attributes or {})
    assert a["error.type"] == "502" and a["http.response.status_code"] == 502
    assert span.status.status_code is StatusCode.ERROR
    assert a["gen_ai.provider.name"] == "anthropic"
    (point,) = t.metric("gen_ai.client.operation.duration")
    assert dict(point.attributes)["error.type"] == "502"


async def test_relayed_route_gets_an_http_span(gateway: GatewayFactory, upstream: Upstream) -> None:
    """A route the gateway only relays (models.list) gets an HTTP CLIENT span, linked to the
    caller and to the upstream like the intercepted ones."""
    t = await traced(gateway)
    async with openai.AsyncOpenAI(base_url=f"{t.gw.url}/v1", api_key=SECRET,
                                  max_retries=0) as c:
        models = await c.models.list(extra_headers=CALLER)
    assert [m.id for m in models.data] == ["gpt-4o-mini"]
    (span,) = await t.spans(1)
    a = dict(span.attributes or {})
    assert span.name == "GET" and span.kind is SpanKind.CLIENT
    assert a["http.request.method"] == "GET" and a["http.response.status_code"] == 200
    assert a["url.full"] == f"{upstream.url}/v1/models"
    assert span.parent is not None and f"{span.parent.span_id:016x}" == CALLER_SPAN
    _, up_parent, _ = parent_of(upstream.received[-1]["headers"]["traceparent"])
    assert up_parent == f"{span.get_span_context().span_id:016x}"
    assert not any(k.startswith("gen_ai.") for k in a)


async def test_span_ends_after_a_background_mem_line(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """With Redis state the [mem] line is written in a background task after the answer;
    the span still ends after its memgate.* attributes are set."""
    import redis.asyncio as redis

    prefix = f"memgate-test-{uuid.uuid4().hex[:8]}"
    url = os.environ.get("MEMGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    t = await traced(gateway, EVICT, env={"MEMGATE_REDIS_URL": url},
                     state={"backend": "redis", "key_prefix": prefix})
    try:
        async with openai.AsyncOpenAI(base_url=f"{t.gw.url}/v1", api_key=SECRET,
                                      max_retries=0) as c:
            for _ in range(2):
                await c.chat.completions.create(model="gpt-4o-mini", messages=history(),  # type: ignore[arg-type]
                                                extra_headers=CALLER)
        spans = await t.spans(2)
        for span, ev, got in zip(spans, t.mem(), upstream.received, strict=True):
            check_span(span, ev, got, "gpt-4o-mini", "openai", "openai_chat")
        assert dict(spans[1].attributes or {})["memgate.cut"] in ("kept", "moved")
    finally:
        r = redis.from_url(url)
        async for key in r.scan_iter(match=f"{prefix}:*"):
            await r.delete(key)
        await r.aclose()


async def test_unsampled_caller_is_propagated_not_recorded(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """A caller's traceparent with the sampled flag off: no span recorded, the upstream gets
    the same trace, still unsampled."""
    t = await traced(gateway)
    header = f"00-{CALLER_TRACE}-{CALLER_SPAN}-00"
    async with openai.AsyncOpenAI(base_url=f"{t.gw.url}/v1", api_key=SECRET,
                                  max_retries=0) as c:
        await c.chat.completions.create(model="gpt-4o-mini", messages=history(2),  # type: ignore[arg-type]
                                        extra_headers={"traceparent": header})
    await t.wait_mem(1)
    assert t.exporter.get_finished_spans() == ()
    trace_id, _, flags = parent_of(upstream.received[-1]["headers"]["traceparent"])
    assert (trace_id, flags) == (CALLER_TRACE, "00")
    assert [p.count for p in t.metric("gen_ai.client.operation.duration")] == [1]


@settings(max_examples=50)
@given(trace_id=st.integers(1, 2**128 - 1), span_id=st.integers(1, 2**64 - 1),
       sampled=st.booleans())
def test_traceparent_continued_and_handed_on(trace_id: int, span_id: int,
                                             sampled: bool) -> None:
    """For any valid caller traceparent: the span continues its trace (same id, same
    sampled flag) and the header going upstream names the span, not the caller, as parent."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(provider)
    header = f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"
    req = make_mocked_request("POST", "/v1/chat/completions", headers={"traceparent": header})
    info = Relayed(status=200)
    span = tracing.start(req, info, OPENAI_CHAT)
    out_trace, out_parent, flags = parent_of(span.headers["traceparent"])
    assert out_trace == f"{trace_id:032x}" and flags == ("01" if sampled else "00")
    assert out_parent == f"{span.span.get_span_context().span_id:016x}" != f"{span_id:016x}"
    span.close(200)
    finished = exporter.get_finished_spans()
    assert len(finished) == (1 if sampled else 0)
    if sampled:
        parent = finished[0].parent
        assert parent is not None and parent.span_id == span_id


def test_tracing_config_is_validated() -> None:
    """tracing.enabled takes true, false or auto; anything else never takes effect."""
    assert build_rules({}).tracing.enabled is False
    assert build_rules({"tracing": {"enabled": "auto"}}).tracing.enabled == "auto"
    with pytest.raises(RulesError, match="true, false or auto"):
        build_rules({"tracing": {"enabled": "yes"}})
    with pytest.raises(RulesError, match="unknown key"):
        build_rules({"tracing": {"endpoint": "http://x"}})
    auto = build_rules({"tracing": {"enabled": "auto"}}).tracing
    assert not auto.active({})
    assert not auto.active({"OTEL_TRACES_EXPORTER": "none"})
    assert auto.active({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert not auto.active({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_SDK_DISABLED": "true"})


async def test_reload_switches_tracing(gateway: GatewayFactory, upstream: Upstream) -> None:
    """tracing.enabled flipped by a config reload: spans start, then stop, without restart."""
    gw = await gateway(env=OFF, fmt="json", watch_interval_s=0.05)
    assert gw.state.tracer is None and gw.state.tracing is None
    text = gw.config.read_text()
    gw.config.write_text(text + "tracing:\n  enabled: true\n")
    for _ in range(200):
        if gw.state.tracer is not None:
            break
        await asyncio.sleep(0.02)
    t = Traced(gw)
    async with aiohttp.ClientSession() as s:
        payload = {"model": "gpt-4o-mini", "messages": history(1)}
        async with s.post(f"{gw.url}/v1/chat/completions", json=payload) as r:
            assert r.status == 200
        await t.spans(1)
        gw.config.write_text(text + "tracing:\n  enabled: false\n")
        for _ in range(200):
            if gw.state.tracer is None:
                break
            await asyncio.sleep(0.02)
        assert gw.state.tracer is None and t.gw.state.tracing.observe not in gw.state.observers
        async with s.post(f"{gw.url}/v1/chat/completions", json=payload) as r:
            assert r.status == 200
    await t.wait_mem(2)
    assert len(t.exporter.get_finished_spans()) == 1


async def test_otlp_http_export_reaches_a_collector(
    gateway: GatewayFactory, upstream: Upstream, aiohttp_server: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tracing.enabled: auto with OTEL_EXPORTER_OTLP_ENDPOINT set: spans and GenAI metrics
    reach a local OTLP/HTTP collector as protobuf, service.name memgate."""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    posts: dict[str, list[bytes]] = {"/v1/traces": [], "/v1/metrics": []}

    async def collect(request: web.Request) -> web.Response:
        assert request.headers["Content-Type"] == "application/x-protobuf"
        posts[request.path].append(await request.read())
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", collect)
    app.router.add_post("/v1/metrics", collect)
    collector = await aiohttp_server(app)
    endpoint = str(collector.make_url("")).rstrip("/")
    for k in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_SERVICE_NAME",
              "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    gw = await gateway(env={"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}, tracing={"enabled": "auto"})
    tracing = gw.state.tracer
    assert tracing is not None
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET,
                                  max_retries=0) as c:
        await c.chat.completions.create(model="gpt-4o-mini", messages=history(2),  # type: ignore[arg-type]
                                        extra_headers=CALLER)
    await gw.wait_mem(1)
    await tracing.shutdown()  # flushes both exporters (off the loop: the collector is on it)
    assert posts["/v1/traces"] and posts["/v1/metrics"]
    for body in posts["/v1/traces"] + posts["/v1/metrics"]:  # what leaves the gateway
        assert SECRET.encode() not in body and TEXT.encode() not in body
    req = ExportTraceServiceRequest.FromString(posts["/v1/traces"][0])
    (rs,) = req.resource_spans
    service = {kv.key: kv.value.string_value for kv in rs.resource.attributes}["service.name"]
    (span,) = [s for ss in rs.scope_spans for s in ss.spans]
    assert service == "memgate" and span.name == "chat gpt-4o-mini"
    assert span.trace_id.hex() == CALLER_TRACE and span.parent_span_id.hex() == CALLER_SPAN
    attrs = {kv.key: kv.value for kv in span.attributes}
    assert attrs["gen_ai.request.model"].string_value == "gpt-4o-mini"
    assert attrs["memgate.evict"].string_value
    metrics = ExportMetricsServiceRequest.FromString(posts["/v1/metrics"][-1])
    names = {m.name for r in metrics.resource_metrics for sm in r.scope_metrics
             for m in sm.metrics}
    assert "gen_ai.client.operation.duration" in names


def test_tracing_off_imports_no_opentelemetry(tmp_path: Path) -> None:
    """With tracing off (the default) a gateway serving a request loads no OpenTelemetry."""
    script = """
import asyncio, sys
from aiohttp import web
from aiohttp.test_utils import TestServer, TestClient
from gateway.proxy.app import create_app
from gateway.config.rules import load_rules

async def main():
    async def chat(r):
        await r.read()
        return web.json_response({"choices": []})
    up = web.Application()
    up.router.add_post("/v1/chat/completions", chat)
    upstream = TestServer(up)
    await upstream.start_server()
    env = {"MEMGATE_UPSTREAM": str(upstream.make_url("")).rstrip("/"),
           "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    async with TestClient(TestServer(create_app(load_rules(None, env), None, env))) as c:
        r = await c.post("/v1/chat/completions", json={"model": "m", "messages": [
            {"role": "user", "content": "hi"}]}, headers={"traceparent": "00-" + "1" * 32
            + "-" + "2" * 16 + "-01"})
        assert r.status == 200, r.status
        await c.get("/v1/models")
    await upstream.close()
    print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))

asyncio.run(main())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=False, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
