"""The HTTP server under the app: aiohttp's, with its own error answers made safe.

A request aiohttp cannot parse (a bare CR or a NUL after a header value, an 8 KB
header line) is answered by the server itself, before any handler or middleware:
a text/plain 400 whose body is the parser's message, which quotes the offending
line, API key included, logged with the same text and a traceback on
`aiohttp.server`. Here such a request gets a JSON 400 in the gateway's error shape
naming only the kind of error (a body both SDKs read: the request's path, so its
API, is unknown), and one `http_bad_request` line without the bytes.
An exception escaping a handler is answered the same way (500, `http_error`).
"""

from __future__ import annotations

import re
import traceback
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from gateway.errors import GatewayError, render_error
from gateway.observe import logging as mglog
from gateway.proxy.error_answers import flavor_for

# the parser quotes what it choked on (repr of the bytes): its message is cut there
_QUOTE = re.compile(r"""\s*\bb?['"].*""", re.DOTALL)
# ... and aiohttp's own log messages at the first repr they hold
_OBJECT = re.compile(r"""[<'"].*""", re.DOTALL)


def safe_reason(exc: BaseException | None) -> str:
    """The kind of a parse error, without any of the request's bytes."""
    text = exc.message if isinstance(exc, HttpProcessingError) else ""
    first = _QUOTE.sub("", str(text).split("\n", 1)[0]).rstrip(" :.")
    return "".join(c for c in first if " " <= c <= "~")[:120] or "malformed request"


def _where(exc: BaseException | None) -> dict[str, str]:
    """An exception's type and the file:line it was raised at; not its text, which
    may quote a request's values."""
    frame = traceback.extract_tb(exc.__traceback__)[-1:] if exc is not None else []
    where = f"{frame[0].filename.rsplit('/', 1)[-1]}:{frame[0].lineno}" if frame else ""
    return {"error": type(exc).__name__, "where": where}


class _SafeErrors(RequestHandler):
    __slots__ = ()

    def log_exception(self, *args: Any, **kw: Any) -> None:
        # aiohttp's other error logs (a failure while writing a response, ...) go to
        # `aiohttp.server` with a traceback: the same one line instead
        exc = kw.get("exc_info")
        what = _OBJECT.sub("", str(args[0]) if args else "")[:80].rstrip(" ,:")
        fields = _where(exc) if isinstance(exc, BaseException) else {}
        mglog.get_logger().error("http_server_error", what=what, **fields)

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        log = mglog.get_logger()
        err = GatewayError("")
        err.status = status
        if status < 500:
            reason = safe_reason(exc)
            err.code, err.message = "bad_http_request", f"malformed HTTP request: {reason}"
            log.warning("http_bad_request", status=status, reason=reason,
                        error=type(exc).__name__, remote=request.remote)
        else:
            err.code = "internal_error" if status == 500 else "timeout"
            err.message = "the gateway failed on this request" if status == 500 else (
                "the gateway did not finish this request in time")
            log.error("http_error", status=status, **_where(exc))
        if request.writer.output_size > 0:  # as aiohttp: too late for another response
            raise ConnectionError("response already started, cannot send the error")
        # a request the parser refused is aiohttp's placeholder (path "/"): its API unknown
        flavor = "any" if isinstance(exc, HttpProcessingError) else flavor_for(request)
        resp = web.Response(status=status, body=render_error(err, flavor),
                            content_type="application/json")
        resp.force_close()
        return resp


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        handler = super().__call__()
        handler.__class__ = _SafeErrors  # same slots: only handle_error differs
        return handler


class GatewayRunner(web.AppRunner):
    """web.AppRunner whose connections answer server-level errors with _SafeErrors
    (aiohttp has no public hook for them: they never reach a middleware)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # no state of its own: only __call__ differs
        return server
