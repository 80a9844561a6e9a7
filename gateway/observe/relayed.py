"""What happened on the wire for one request: filled by the relay, read by the [mem] line,
the metrics, the console and tracing."""

from __future__ import annotations

from dataclasses import dataclass

# an upstream's refusals of a body as invalid: the answers a body the gateway changed is
# resent for, as the client sent it (a 401, 429 or 5xx is not about the body)
REFUSALS = frozenset((400, 413, 422))


@dataclass(slots=True)
class Relayed:
    """What happened on the wire, for the [mem] line and metrics."""

    status: int = 0
    upstream_ms: float = 0.0
    bytes_out: int = 0
    stream: str = "complete"  # complete | upstream_aborted | client_gone
    ended: bool = False  # the upstream's terminal event was relayed to the client
    first_status: int = 0  # the refusal of the changed body, when the original was resent
    # the provider's own token counts read from the answer (JSON or SSE), when it sent them:
    # keys input, cached, output (and cache_write for Anthropic)
    usage: dict[str, int] | None = None
    # the answer's own model and id, read with the usage (None: not sent or not read)
    response_model: str | None = None
    response_id: str | None = None
    # the caller's tenant (None: no usable credential), for observers that keep per-session
    # state: a session id two tenants share is two sessions
    tenant: str | None = None
    # memory.retrieve: the rounds memgate asked the upstream again after answering its
    # retrieval tool, their time and own tokens, and why a round failed (None: none did)
    retrieve_rounds: int = 0
    retrieve_ms: float = 0.0
    retrieve_in: int = 0
    retrieve_out: int = 0
    retrieve_error: str | None = None

    def client_left(self) -> None:
        """The client hung up: a stream it was sent to its terminal event is complete
        (the openai SDK closes right after [DONE], before the upstream ends the body)."""
        self.stream = "complete" if self.ended else "client_gone"
