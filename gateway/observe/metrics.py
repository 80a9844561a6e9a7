"""Prometheus metrics (`GET /metrics`). Labels are bounded: api, mode, status code,
reload result, a models-file glob — never a session id or a model name a client can invent.

No `_created` series (one per labelled child: they double the scrape and no query of
ours reads them), the process's own CPU/memory/fds (ProcessCollector on this registry),
and the children of every bounded label set exist at 0 from the start: a `rate()` or a
ratio over a counter that has not been incremented yet reads 0, not "no data".

Under `memgate serve --workers N` every worker writes its counters and histograms to
prometheus_client's per-process files in PROMETHEUS_MULTIPROC_DIR (set by the parent for
the workers only) and a scrape of any worker sums every worker's files: one target. The
values read at scrape time from in-process objects (history cache, backends) are copied
into those files once a second and at each scrape of that worker, so another worker's
figures there may be up to a second old.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gateway.observe.relayed import REFUSALS
from gateway.wire import WIRES

if TYPE_CHECKING:
    from gateway.decide.decision import Decision
    from gateway.decide.history import HistoryCache
    from gateway.memory.backends import Backend
    from gateway.observe.relayed import Relayed

# the API resources a relayed path can name; any other path counts as "other" (a label
# never holds a raw path: ids, deployment names and typos would each make a new series)
ROUTE_CLASSES = frozenset({
    "models", "embeddings", "files", "uploads", "batches", "images", "audio", "moderations",
    "completions", "chat", "responses", "messages", "fine_tuning", "assistants", "threads",
    "vector_stores", "realtime", "conversations", "containers", "evals",
})
_PREFIX_SEGMENTS = frozenset({"", "openai", "v1"})


def route_class(path: str) -> str:
    """The API resource of a relayed path: /v1/models/gpt-4o -> models, Azure's
    /openai/deployments/{name}/embeddings -> embeddings, anything unknown -> other."""
    parts = path.split("/")
    i = 0
    while i < len(parts) and parts[i] in _PREFIX_SEGMENTS:
        i += 1
    if i < len(parts) and parts[i] == "deployments":
        i += 2  # the deployment's name is the operator's, not a resource
    head = parts[i] if i < len(parts) else ""
    return head if head in ROUTE_CLASSES else "other"


TOKEN_BUCKETS = (250, 500, 1000, 2000, 4000, 8000, 16000, 32000, 64000, 128000, 256000)
DROP_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
# the label values known before any request: each wire's route name (as the [mem] line's
# api=), the three modes, the refusals that trigger a resend of the original, the reload
# results. Statuses are open-ended: only 200 is made up front.
ROUTES = tuple(sorted({w.name for w in WIRES.values()}))
MODES = ("off", "shadow", "on")
RELOAD_RESULTS = ("ok", "failed")
SECOND_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                  10, 30, 60)


class Metrics:
    """One registry per gateway app (tests run several apps in one process)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, shared_dir: str | None = None) -> None:
        # process-wide in prometheus_client (we own the process): no `_created` samples
        disable_created_metrics()  # type: ignore[no-untyped-call]
        # the workers' shared directory (None: one process, everything in this registry)
        self.shared_dir = shared_dir or os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
        self._mirrors: list[_Mirror] = []
        self._all: CollectorRegistry | None = None
        if self.shared_dir is not None:
            from prometheus_client.multiprocess import MultiProcessCollector

            self._all = CollectorRegistry()
            MultiProcessCollector(self._all, path=self.shared_dir)  # type: ignore[no-untyped-call]
        r = self.registry = CollectorRegistry()
        # process_cpu_seconds_total, resident memory, open fds; python_info: which
        # interpreter serves. With several workers: CPU and memory summed over them
        self._watch(ProcessCollector(registry=None), {
            "process_start_time_seconds": "livemin", "process_max_fds": "livemax"})
        self._watch(PlatformCollector(registry=None), {"python_info": "livemax"})
        self.requests = Counter("memgate_requests_total", "Requests by route, mode and status",
                                ["route", "mode", "status"], registry=r)
        self.tokens_before = Histogram("memgate_history_tokens_before",
                                       "Estimated request tokens as the client sent them",
                                       ["route"], buckets=TOKEN_BUCKETS, registry=r)
        self.tokens_after = Histogram("memgate_history_tokens_after",
                                      "Estimated request tokens as forwarded",
                                      ["route"], buckets=TOKEN_BUCKETS, registry=r)
        self.dropped = Histogram("memgate_dropped_messages", "Messages dropped per request",
                                 ["route"], buckets=DROP_BUCKETS, registry=r)
        self.overhead = Histogram("memgate_gateway_overhead_seconds",
                                  "Gateway time before forwarding", ["route"],
                                  buckets=SECOND_BUCKETS, registry=r)
        self.upstream = Histogram("memgate_upstream_latency_seconds",
                                  "Time to upstream response headers", ["route"],
                                  buckets=SECOND_BUCKETS, registry=r)
        self.pinned = Counter("memgate_pinned_kept_total", "Pinned messages kept", registry=r)
        self.pinned_overflow = Counter("memgate_pinned_overflow_total",
                                       "Pinned messages beyond max_pinned in a history "
                                       "that was cut", registry=r)
        self.over_budget = Counter("memgate_over_budget_total",
                                   "Requests whose forced part exceeded the budget", registry=r)
        self.skipped = Counter("memgate_evict_skipped_total", "Requests not planned",
                               ["route"], registry=r)
        self.reloads = Counter("memgate_config_reloads_total", "Config reloads", ["result"],
                               registry=r)
        self.bytes_relayed = Counter("memgate_relayed_bytes_total",
                                     "Response bytes relayed to clients", ["route"], registry=r)
        self.relayed = Counter("memgate_relayed_total",
                               "Requests on relayed routes (/v1/models, /v1/embeddings, ...: not "
                               "intercepted) by route class and status",
                               ["route_class", "status"], registry=r)
        self.fallback = Counter("memgate_fallback_total",
                                "Changed bodies the upstream refused, resent as the client "
                                "sent them, by route and the refusal's status",
                                ["route", "status"], registry=r)
        self.retrieve = Counter("memgate_retrieve_rounds_total",
                                "Upstream rounds memgate asked after answering its retrieval "
                                "tool, by route and result (ok, failed)",
                                ["route", "result"], registry=r)
        self.retrieve_tokens = Counter("memgate_retrieve_tokens",
                                       "Tokens the retrieval rounds cost, by route and kind "
                                       "(input, output)", ["route", "kind"], registry=r)
        self.usage = Counter("memgate_usage_tokens",
                             "Tokens the provider reported in its answers' usage, by route, "
                             "model (the models file's matching `match` glob, else other) "
                             "and kind: input (every prompt token, cached ones included), "
                             "cached, output, cache_write (Anthropic)",
                             ["route", "model", "kind"], registry=r)
        # labelled children by route / (route, mode, status): bounded like the labels
        self._routes: dict[str, _Route] = {}
        self._requests: dict[tuple[str, str, int], Any] = {}
        self._usage: dict[tuple[str, str, str], Any] = {}
        self._preinit()

    def _preinit(self) -> None:
        """Every child of a bounded label set, at 0 (see the module docstring)."""
        for route in ROUTES:
            self._route(route)
            for mode in MODES:
                self._requests[(route, mode, 200)] = self.requests.labels(route, mode, "200")
            for status in sorted(REFUSALS):
                self.fallback.labels(route, str(status))
        for result in RELOAD_RESULTS:
            self.reloads.labels(result)

    def watch_history(self, cache: HistoryCache) -> None:
        """Export the per-session history cache: hits, misses, entries, estimated bytes."""
        self._watch(_HistoryCollector(cache))

    def watch_backends(self, backends: list[Backend]) -> None:
        """Export each backend's failures by operation, skipped calls and breaker state
        (with several workers: `up` is the lowest of the live workers')."""
        self._watch(_BackendCollector(backends), {"memgate_backend_up": "livemin"})

    def _watch(self, collector: _Collector, modes: dict[str, str] | None = None) -> None:
        if self.shared_dir is None:
            self.registry.register(collector)
        else:
            self._mirrors.append(_Mirror(collector, modes or {}))

    def publish(self) -> None:
        """Copy this worker's scrape-time values into the shared files (workers only)."""
        for mirror in self._mirrors:
            mirror.publish()

    async def publish_every(self, interval_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.publish()

    def _route(self, route: str) -> _Route:
        r = self._routes.get(route)
        if r is None:  # a handful of routes: each metric's child looked up once
            r = self._routes[route] = _Route(
                self.overhead.labels(route), self.upstream.labels(route),
                self.bytes_relayed.labels(route), self.skipped.labels(route),
                self.tokens_before.labels(route), self.tokens_after.labels(route),
                self.dropped.labels(route))
        return r

    def observe(
        self, route: str, mode: str, d: Decision | None, info: Relayed, overhead_s: float,
        est_tokens: int | None,
    ) -> None:
        key = (route, mode, info.status or 499)
        counter = self._requests.get(key)
        if counter is None:
            counter = self._requests[key] = self.requests.labels(route, mode, str(key[2]))
        counter.inc()
        r = self._route(route)
        r.overhead.observe(overhead_s)
        if info.status:
            r.upstream.observe(info.upstream_ms / 1000)
        r.bytes_relayed.inc(info.bytes_out)
        if info.first_status:  # statuses: REFUSALS only
            self.fallback.labels(route, str(info.first_status)).inc()
        if info.retrieve_rounds:
            failed = info.retrieve_error is not None
            self.retrieve.labels(route, "ok").inc(info.retrieve_rounds - failed)
            if failed:
                self.retrieve.labels(route, "failed").inc()
            self.retrieve_tokens.labels(route, "input").inc(info.retrieve_in)
            self.retrieve_tokens.labels(route, "output").inc(info.retrieve_out)
        if d is None:
            return
        if d.skip_reason is not None:
            r.skipped.inc()
        if est_tokens is not None:
            r.tokens_before.observe(est_tokens)
            p = d.plan
            if p is not None and mode == "on" and p.dropped:
                after = d.kept_tokens()
            else:
                after = est_tokens
            r.tokens_after.observe(after)
        p = d.plan
        if p is not None:
            r.dropped.observe(len(p.dropped) if mode == "on" else 0)
            self.pinned.inc(p.pinned)
            self.pinned_overflow.inc(p.pinned_overflow)
            if p.over_budget:
                self.over_budget.inc()

    def observe_usage(self, route: str, model_match: str, usage: dict[str, int]) -> None:
        """Count the provider's own numbers. `model_match` is a glob of the models file
        ("*" for its default), never the client's model string: the label stays bounded
        by the config."""
        model = "other" if model_match == "*" else model_match
        for kind, n in usage.items():
            key = (route, model, kind)
            child = self._usage.get(key)
            if child is None:
                child = self._usage[key] = self.usage.labels(route, model, kind)
            child.inc(n)
    def observe_relayed(self, route_class: str, status: int) -> None:
        self.relayed.labels(route_class, str(status or 499)).inc()

    def render(self) -> bytes:
        if self._all is None:
            return generate_latest(self.registry)
        self.publish()
        return generate_latest(self._all)


@dataclass(frozen=True, slots=True)
class _Route:
    overhead: Any
    upstream: Any
    bytes_relayed: Any
    skipped: Any
    tokens_before: Any
    tokens_after: Any
    dropped: Any


class _HistoryCollector:
    """Read at scrape time: nothing is counted twice on the request path."""

    def __init__(self, cache: HistoryCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[Metric]:
        c = self.cache
        yield CounterMetricFamily("memgate_history_cache_hits",
                                  "Requests whose session history was parsed only where it grew",
                                  value=c.hits)
        yield CounterMetricFamily("memgate_history_cache_misses",
                                  "Requests parsed from the start (new, edited or evicted)",
                                  value=c.misses)
        yield CounterMetricFamily("memgate_history_cache_spliced",
                                  "Bodies (16 KiB and more) parsed only after the bytes the "
                                  "session's previous body shares with them",
                                  value=c.spliced)
        yield GaugeMetricFamily("memgate_history_cache_entries", "Sessions held",
                                value=len(c))
        yield GaugeMetricFamily("memgate_history_cache_bytes",
                                "Estimated memory held (bounded by session.history_cache_mb)",
                                value=c.bytes)


class _BackendCollector:
    """Read at scrape time from the breakers: a failing backend costs no metric work per
    request (labels: backend = redis | store | archive, op = its operation: both bounded)."""

    def __init__(self, backends: list[Backend]) -> None:
        self.backends = backends

    def collect(self) -> Iterator[Metric]:
        errors = CounterMetricFamily("memgate_backend_errors",
                                     "Backend calls that failed or timed out",
                                     labels=["backend", "op"])
        skipped = CounterMetricFamily("memgate_backend_skipped",
                                      "Backend calls not made: it failed within retry_after_s",
                                      labels=["backend"])
        up = GaugeMetricFamily("memgate_backend_up",
                               "1 while the backend answers, 0 while it is skipped",
                               labels=["backend"])
        for b in self.backends:
            for op, n in sorted(b.errors.items()):
                errors.add_metric([b.name, op], n)
            skipped.add_metric([b.name], b.skipped)
            up.add_metric([b.name], 1 if b.up else 0)
        yield errors
        yield skipped
        yield up


class _Collector(Protocol):
    def collect(self) -> Iterable[Metric]: ...


class _Mirror:
    """A collector's counters and gauges as per-process metrics of the shared directory:
    a counter grows by what it grew since the last copy (a dead worker's count stays in
    the sum, as the request counters' do); a gauge is summed over the live workers
    unless `modes` says otherwise (the parent removes a dead worker's gauges)."""

    def __init__(self, collector: _Collector, modes: dict[str, str]) -> None:
        self.collector = collector
        self.modes: dict[str, Any] = modes  # name -> prometheus_client multiprocess_mode
        self._metrics: dict[str, Any] = {}
        self._last: dict[tuple[str, tuple[str, ...]], float] = {}

    def publish(self) -> None:
        for family in self.collector.collect():
            for sample in family.samples:
                labels = tuple(sample.labels.values())
                metric = self._metric(family, tuple(sample.labels))
                child = metric.labels(*labels) if labels else metric
                if family.type == "counter":
                    key = (family.name, labels)
                    grew = sample.value - self._last.get(key, 0.0)
                    if grew > 0:
                        child.inc(grew)
                        self._last[key] = sample.value
                else:
                    child.set(sample.value)

    def _metric(self, family: Metric, labelnames: tuple[str, ...]) -> Any:
        metric = self._metrics.get(family.name)
        if metric is None:  # registry=None: the shared files are what a scrape reads
            if family.type == "counter":
                metric = Counter(family.name, family.documentation, labelnames, registry=None)
            else:
                metric = Gauge(family.name, family.documentation, labelnames, registry=None,
                               multiprocess_mode=self.modes.get(family.name, "livesum"))
            self._metrics[family.name] = metric
        return metric
