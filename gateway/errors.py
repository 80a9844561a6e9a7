"""Errors the gateway itself raises, and their JSON rendering.

    GatewayError                 base: carries an HTTP status and a code
    ├── BadRequest               400: the client's body breaks a gateway rule
    │   └── BadPath              400: a path with dot-segments (never routed)
    ├── Unauthorized             401: a route with the gateway's own key, caller not allowed
    ├── PayloadTooLarge          413: body over limits.max_body_bytes (also once decoded)
    ├── UnsupportedEncoding      415: a Content-Encoding the gateway cannot decode
    ├── OverBudget               400: on_over_budget=reject and the forced part is too big
    ├── UpstreamUnreachable      502: connect refused / DNS / reset before a response
    └── UpstreamTimeout          504: connect or read timeout before a response

    RulesError                   config invalid: file, line, key, reason (never served)
    CommandError                 a CLI command cannot run: one line and an exit code

Bodies are rendered in one place, in the shape of the API the client speaks.
"""

from __future__ import annotations

from typing import Literal

import orjson

# "any": a request whose path is unknown (the HTTP parser refused it): a body both
# SDKs read, Anthropic's shape with OpenAI's fields inside its `error`
ApiFlavor = Literal["openai", "anthropic", "any"]


class GatewayError(Exception):
    status = 500
    code = "gateway_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(GatewayError):
    status = 400
    code = "invalid_request"


class BadPath(BadRequest):
    code = "invalid_path"


class Unauthorized(GatewayError):
    status = 401
    code = "unauthorized"


class PayloadTooLarge(GatewayError):
    status = 413
    code = "payload_too_large"


class UnsupportedEncoding(GatewayError):
    status = 415
    code = "unsupported_content_encoding"


class OverBudget(GatewayError):
    status = 400
    code = "context_over_budget"


class UpstreamUnreachable(GatewayError):
    status = 502
    code = "upstream_unreachable"


class UpstreamTimeout(GatewayError):
    status = 504
    code = "upstream_timeout"


class RulesError(Exception):
    """A config that must not take effect: where it is wrong and why."""

    def __init__(self, file: str, line: int | None, key: str, reason: str) -> None:
        self.file, self.line, self.key, self.reason = file, line, key, reason
        where = f"{file}:{line}" if line else file
        super().__init__(f"{where}: {key}: {reason}")


class CommandError(Exception):
    """A command that cannot do its job for a reason the user can fix (a port in use,
    a host that does not resolve): `memgate` prints the message alone, no traceback,
    and exits with `code` (1: runtime failure, 2: usage or config error)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def render_error(err: GatewayError, flavor: ApiFlavor = "openai") -> bytes:
    """JSON error body in the client's API shape."""
    if flavor != "openai":
        anthropic_type = {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            413: "request_too_large",
            415: "invalid_request_error",
            502: "api_error",
            504: "timeout_error",
        }.get(err.status, "api_error")
        error: dict[str, object] = {"type": anthropic_type, "message": err.message}
        if flavor == "any":
            error |= {"code": err.code, "param": None}
        return orjson.dumps({"type": "error", "error": error})
    return orjson.dumps(
        {"error": {"message": err.message, "type": "gateway_error", "code": err.code,
                   "param": None}}
    )
