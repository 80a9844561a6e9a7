"""OpenTelemetry: one span per proxied request, the caller's trace continued upstream.

Imported only while `tracing.enabled` is on (the `otel` extra): with tracing off the
gateway loads nothing of OpenTelemetry and a request pays one attribute test.

An intercepted request is a CLIENT span of the GenAI semantic conventions
(`chat {model}`, gen_ai.* attributes) carrying what its [mem] line says as memgate.*
attributes; any other relayed route is a plain HTTP CLIENT span. The span is a child of
the caller's `traceparent` and the upstream gets a `traceparent` naming the span as its
parent. The [mem] fields arrive through the gateway's observers, possibly after the
handler returned (a shared state backend writes the line in a background task): the
span ends when the accounting is done, stamped with the time the response was.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from contextvars import ContextVar
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from opentelemetry import trace
from opentelemetry.metrics import Histogram, MeterProvider
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from gateway.config.schema import Upstream, target_url
from gateway.observe.relayed import Relayed
from gateway.wire.base import Wire

# the [mem] fields that have a GenAI / HTTP name of their own (the rest become memgate.*)
_SEMCONV_FIELDS = frozenset(("session", "model", "status", "usage_in", "usage_out"))
# per-message index lists (debug level): as long as the history, not for a span
_UNBOUNDED_FIELDS = frozenset(("kept_idx", "dropped_idx"))
MAX_VALUE_CHARS = 256  # model names and ids come from clients
# the GenAI semantic conventions' advised buckets
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304,
                 16777216, 67108864)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92)
_AZURE_HOSTS = (".openai.azure.com", ".cognitiveservices.azure.com", ".services.ai.azure.com")
# the span of the request this task serves (set by Tracing.start, read by the observer)
_CURRENT: ContextVar[RequestSpan | None] = ContextVar("memgate_span", default=None)


def _clip(v: str) -> str:
    return v if len(v) <= MAX_VALUE_CHARS else v[:MAX_VALUE_CHARS]


@functools.lru_cache(maxsize=256)  # per configured upstream
def _server(up: Upstream) -> tuple[tuple[str, Any], ...]:
    u = urlsplit(up.base_url)
    port = u.port or (443 if u.scheme == "https" else 80)
    return (("server.address", u.hostname or ""), ("server.port", port))


def provider_name(wire: Wire, path: str, up: Upstream | None = None) -> str:
    """gen_ai.provider.name: Anthropic by wire; Azure OpenAI by its routes or host."""
    if wire.flavor == "anthropic":
        return "anthropic"
    host = _server(up)[0][1] if up is not None else ""
    if path.startswith("/openai/") or host.endswith(_AZURE_HOSTS):
        return "azure.ai.openai"
    return "openai"


def _request_params(payload: Any) -> dict[str, Any]:
    """The sampling parameters of a request body (numbers and flags only, never text)."""
    out: dict[str, Any] = {}
    if not isinstance(payload, dict):
        return out
    if isinstance(payload.get("stream"), bool):
        out["gen_ai.request.stream"] = payload["stream"]
    for key, name in (("max_tokens", "gen_ai.request.max_tokens"),
                      ("max_completion_tokens", "gen_ai.request.max_tokens"),
                      ("max_output_tokens", "gen_ai.request.max_tokens"),
                      ("temperature", "gen_ai.request.temperature"),
                      ("top_p", "gen_ai.request.top_p")):
        v = payload.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool):
            out[name] = v
    return out


def _usage(fields: Mapping[str, Any], info: Relayed) -> tuple[int | None, int | None]:
    """(input, output) tokens the provider reported: the [mem] line's usage_in/usage_out,
    else what the relay read from the answer."""
    got = info.usage or {}
    tokens_in, tokens_out = fields.get("usage_in"), fields.get("usage_out")
    if not isinstance(tokens_in, int):
        tokens_in = got.get("input")
    if not isinstance(tokens_out, int):
        tokens_out = got.get("output")
    return tokens_in, tokens_out


def error_type(status: int, stream: str) -> str | None:
    """error.type: the HTTP status of a failed answer, or how a stream broke off."""
    if status >= 400:
        return str(status)
    return stream if stream != "complete" else None


class RequestSpan:
    """One request's span: started by the handler, given the [mem] fields by the observer,
    ended when the handler's accounting has run (`after`) or the relay returned (`close`)."""

    __slots__ = ("_ended", "_fields", "_tracing", "base", "decision", "end_ns", "headers",
                 "info", "span", "t0", "wire")

    def __init__(self, tracing: Tracing, span: trace.Span, info: Relayed, wire: Wire | None,
                 headers: dict[str, str]) -> None:
        self._tracing, self.span, self.info, self.wire = tracing, span, info, wire
        self.headers = headers  # traceparent (and tracestate) naming this span as parent
        self.t0 = time.perf_counter()
        self.end_ns: int | None = None
        self.base: dict[str, Any] = {}  # attributes known once the upstream is chosen
        self._fields: Mapping[str, Any] | None = None
        self.decision: Any = None
        self._ended = False

    def upstream(self, request: web.Request, up: Upstream) -> dict[str, str]:
        """The headers that carry this span upstream; notes where the request goes."""
        self.base.update(_server(up))
        if self.wire is not None:
            self.base["gen_ai.provider.name"] = provider_name(self.wire, request.path, up)
        else:
            self.base["url.full"] = target_url(up, request.path)  # no query: it may hold a key
        return self.headers

    def annotate(self, fields: Mapping[str, Any], decision: Any) -> None:
        self._fields, self.decision = fields, decision

    def after(self, accounting: Awaitable[None]) -> Coroutine[Any, Any, None]:
        """`accounting`, then the end of the span (stamped now: the response is done)."""
        self.end_ns = time.time_ns()
        duration = time.perf_counter() - self.t0
        return self._after(accounting, duration)

    async def _after(self, accounting: Awaitable[None], duration: float) -> None:
        try:
            await accounting
        finally:
            self.end(duration)

    def close(self, status: int) -> None:
        """End a relayed (not intercepted) request's span with its response status."""
        self.end_ns = time.time_ns()
        if not self.info.status:
            self.info.status = status
        self.end(time.perf_counter() - self.t0)

    def end(self, duration: float) -> None:
        if self._ended:
            return
        self._ended = True
        try:
            self._tracing.finish(self, self._fields or {}, duration)
        except Exception as exc:  # noqa: BLE001 - tracing never fails a request
            self._tracing.failed(exc)
        finally:
            self.span.end(end_time=self.end_ns)


class Tracing:
    """The gateway's tracer and (optional) GenAI metrics over given SDK providers."""

    def __init__(self, tracer_provider: trace.TracerProvider,
                 meter_provider: MeterProvider | None = None,
                 log: Callable[[], Any] = lambda: None,
                 shutdown: Callable[[], None] = lambda: None) -> None:
        self.tracer = tracer_provider.get_tracer("memgate")
        self._log = log
        self._shutdown = shutdown
        self.duration: Histogram | None = None
        self.tokens: Histogram | None = None
        if meter_provider is not None:
            meter = meter_provider.get_meter("memgate")
            self.duration = meter.create_histogram(
                "gen_ai.client.operation.duration", unit="s",
                description="GenAI operation duration.",
                explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
            self.tokens = meter.create_histogram(
                "gen_ai.client.token.usage", unit="{token}",
                description="Number of input and output tokens used.",
                explicit_bucket_boundaries_advisory=TOKEN_BUCKETS)

    def start(self, request: web.Request, info: Relayed, wire: Wire | None) -> RequestSpan:
        """A span for this request, child of the caller's traceparent (if any); `wire`:
        the API of an intercepted request, None for a relayed one."""
        parent = extract(request.headers)
        if wire is not None:
            attrs: dict[str, Any] = {"gen_ai.operation.name": "chat", "memgate.api": wire.name,
                                     "gen_ai.provider.name": provider_name(wire, request.path)}
            name = "chat"
        else:
            attrs = {"http.request.method": request.method}
            name = request.method
        span = self.tracer.start_span(name, context=parent, kind=SpanKind.CLIENT,
                                      attributes=attrs)
        headers: dict[str, str] = {}
        inject(headers, context=trace.set_span_in_context(span, parent))
        rs = RequestSpan(self, span, info, wire, headers)
        if wire is not None:
            rs.base["gen_ai.provider.name"] = attrs["gen_ai.provider.name"]
        _CURRENT.set(rs)
        return rs

    def observe(self, fields: dict[str, Any], decision: Any, info: Any) -> None:
        """The gateway observer: hands the [mem] fields to the span of their request."""
        rs = _CURRENT.get()
        if rs is not None and rs.info is info:
            rs.annotate(fields, decision)

    def finish(self, rs: RequestSpan, fields: Mapping[str, Any], duration: float) -> None:
        """Set the span's attributes from the [mem] fields and record the metrics."""
        info = rs.info
        status = fields.get("status") or info.status or 499
        err = error_type(status, info.stream)
        model = fields.get("model")
        model = _clip(model) if isinstance(model, str) and model else None
        tokens_in, tokens_out = _usage(fields, info)
        common: dict[str, Any] = {**rs.base}
        if rs.wire is not None:
            common["gen_ai.operation.name"] = "chat"
            if model:
                common["gen_ai.request.model"] = model
            if info.response_model:  # the provider's (a dated snapshot, a deployment's)
                common["gen_ai.response.model"] = _clip(info.response_model)
        span = rs.span
        if span.is_recording():
            attrs = {**common, "http.response.status_code": status}
            if rs.wire is not None:
                attrs["gen_ai.system"] = attrs["gen_ai.provider.name"]  # its older name
                attrs.update(self._genai(fields, rs.decision, info, tokens_in, tokens_out))
                if model:
                    span.update_name(f"chat {model}")
            if err is not None:
                attrs["error.type"] = err
                span.set_status(Status(StatusCode.ERROR))
            span.set_attributes(attrs)
        if rs.wire is None:
            return
        if err is not None:
            common["error.type"] = err
        if self.duration is not None:
            self.duration.record(duration, common)
        common.pop("error.type", None)
        if self.tokens is not None:
            for kind, n in (("input", tokens_in), ("output", tokens_out)):
                if isinstance(n, int):
                    self.tokens.record(n, {**common, "gen_ai.token.type": kind})

    def _genai(self, fields: Mapping[str, Any], decision: Any, info: Relayed,
               tokens_in: int | None, tokens_out: int | None) -> dict[str, Any]:
        """The GenAI request/usage attributes and the [mem] line as memgate.*."""
        out = _request_params(getattr(decision, "payload", None))
        session = fields.get("session")
        if isinstance(session, str) and session:
            out["gen_ai.conversation.id"] = _clip(session)
        if info.response_id:
            out["gen_ai.response.id"] = _clip(info.response_id)
        if isinstance(tokens_in, int):
            out["gen_ai.usage.input_tokens"] = tokens_in
        if isinstance(tokens_out, int):
            out["gen_ai.usage.output_tokens"] = tokens_out
        got = info.usage or {}
        if isinstance(got.get("cached"), int):
            out["gen_ai.usage.cache_read.input_tokens"] = got["cached"]
        if isinstance(got.get("cache_write"), int):
            out["gen_ai.usage.cache_creation.input_tokens"] = got["cache_write"]
        for k, v in fields.items():
            if k in _SEMCONV_FIELDS or k in _UNBOUNDED_FIELDS or v is None:
                continue
            if isinstance(v, str):
                out[f"memgate.{k}"] = _clip(v)
            elif isinstance(v, bool | int | float):
                out[f"memgate.{k}"] = v
        return out

    def failed(self, exc: Exception) -> None:
        log = self._log()
        if log is not None:
            log.error("tracing_failed", error=type(exc).__name__, detail=str(exc)[:200])

    async def shutdown(self) -> None:
        """Flush what is queued (at most the exporters' timeouts) off the event loop; once."""
        done, self._shutdown = self._shutdown, lambda: None
        await asyncio.get_running_loop().run_in_executor(None, done)


def _resource() -> Resource:
    """OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES as given; the service is `memgate`
    when they do not name one."""
    res = Resource.create()
    name = res.attributes.get(SERVICE_NAME)
    if not isinstance(name, str) or name.startswith("unknown_service"):
        res = res.merge(Resource({SERVICE_NAME: "memgate"}))
    return res


def _exporters(env: Mapping[str, str], var: str) -> list[str]:
    return [e.strip().lower() for e in env.get(var, "otlp").split(",") if e.strip()]


def from_env(env: Mapping[str, str], log: Callable[[], Any]) -> Tracing:
    """Providers set up as the standard variables say: OTEL_TRACES_EXPORTER and
    OTEL_METRICS_EXPORTER (otlp, console or none; otlp by default) and the
    OTEL_EXPORTER_OTLP_* variables, which the OTLP/HTTP exporters read themselves."""
    resource = _resource()
    logger = log()
    protocol = env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    if protocol != "http/protobuf" and logger is not None:
        logger.warning("tracing_protocol", protocol=protocol,
                       detail="only http/protobuf is shipped: exporting with it")
    tracer_provider = TracerProvider(resource=resource)
    for name in _exporters(env, "OTEL_TRACES_EXPORTER"):
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif name == "console":
            tracer_provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif name != "none" and logger is not None:
            logger.warning("tracing_exporter_unknown", exporter=name,
                           variable="OTEL_TRACES_EXPORTER")
    meter_provider = None
    readers: list[Any] = []
    for name in _exporters(env, "OTEL_METRICS_EXPORTER"):
        if name in ("otlp", "console"):
            from opentelemetry.sdk.metrics.export import (
                ConsoleMetricExporter,
                PeriodicExportingMetricReader,
            )

            if name == "otlp":
                from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                    OTLPMetricExporter,
                )

                readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
            else:
                readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
        elif name != "none" and logger is not None:
            logger.warning("tracing_exporter_unknown", exporter=name,
                           variable="OTEL_METRICS_EXPORTER")
    if readers:
        from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider

        meter_provider = SdkMeterProvider(metric_readers=readers, resource=resource)

    def shutdown() -> None:
        tracer_provider.shutdown()
        if meter_provider is not None:
            meter_provider.shutdown()

    return Tracing(tracer_provider, meter_provider, log, shutdown)
