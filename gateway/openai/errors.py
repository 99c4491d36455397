"""The OpenAI error format: `ApiError`, and a request body checked against its model or refused with a 400.

Every refusal names the field: `param` is its path as the client wrote it (`messages[0].content[1].type`,
`stream_options.include_usage`), and the message starts with that path (`n: expected an integer, got string`).
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from engine.client import EngineDeadError, RequestFailedError
from pools.config.typed import FieldError, convert

T = TypeVar("T")


class ApiError(Exception):
    """An error answered in the OpenAI error format: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers or {}   # e.g. Retry-After on a 503

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def named_error(message: str) -> ApiError:
    """A 400 for a refusal whose message starts with the field's path (`"top_p: must be in [0, 1]"`, as the
    tokenizer, the engine and the tool checks write them): that path is its `param`."""
    return ApiError(400, message, param=message.split(":", 1)[0] if ":" in message else None)


def renamed_field(message: str, names: dict[str, str]) -> str:
    """`message` (`"field: reason"`, as the engine names a chat body's fields) with its field as `names` calls
    it for this request (the field that set its grammar, `messages` for a chat prompt)."""
    field, colon, rest = message.partition(":")
    return names.get(field, field) + colon + rest if colon else message


def field_error(err: FieldError) -> ApiError:
    """A value that does not fit its model as a 400 naming its path (`body` for the whole body)."""
    return bad_request(err.path or "body", err.reason)


def convert_body(value: Any, model: type[T], *, root: str = "") -> T:
    """`value` (decoded JSON) as an instance of the `msgspec.Struct` `model`, or an ApiError 400 naming the
    field that does not fit (under `root`, the path of `value` itself)."""
    try:
        return convert(value, model, root=root)
    except FieldError as err:
        raise field_error(err) from None


DRAIN_CUT = "cliffguard: the drain ended"   # the cancel message of a request cut at the end of the drain


def shutting_down() -> ApiError:
    """The 503 of an HTTP request still waiting or running when the gateway's drain ended."""
    return ApiError(503, "the gateway is stopping: the request ran past gateway.drain_seconds and was cut; retry it",
                    type="server_error", code="server_shutting_down", headers={"Retry-After": "1"})


def drain_cut(exc: BaseException) -> ApiError | None:
    """`shutting_down()` where `exc` is the CancelledError the gateway cut a request with at the drain's end
    (`gateway.runtime.Gateway.cut_in_flight`), the cancel taken back from the current task (whose except
    block asks: the request goes on to answer that error); None for any other cancel."""
    if not (isinstance(exc, asyncio.CancelledError) and exc.args == (DRAIN_CUT,)):
        return None
    asyncio.current_task().uncancel()
    return shutting_down()


def storage_unavailable(store: str, exc: BaseException) -> ApiError:
    """The 503 of a request whose store failed (disk full, locked past the busy timeout): retry later."""
    return ApiError(503, f"the {store} cannot be used now ({exc}); try again later", type="server_error",
                    code="storage_unavailable", headers={"Retry-After": "10"})


MAX_JSON_DEPTH = 64   # arrays and objects in a request nest no deeper (a JSON schema's few levels, and room)


def nested_over(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `value`'s arrays and objects nest over `limit` deep (what reads a body later, the schema
    compiler, `json.dumps`, a chat template's `tojson`, recurses)."""
    level, depth = [value], 0
    while level:
        depth += 1
        if depth > limit:
            return True
        level = [child for node in level
                 for child in (node.values() if isinstance(node, dict) else node if isinstance(node, list) else ())
                 if isinstance(child, (dict, list))]
    return False


def check_depth(body: Any, raw: bytes | None = None) -> Any:
    """`body`, or a 400 naming it when it nests over `MAX_JSON_DEPTH` (`raw`: its JSON text, whose bracket
    count bounds the depth, so a large flat body is not walked)."""
    if raw is not None and raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return body
    if nested_over(body):
        raise ApiError(400, f"body: the JSON is nested too deeply (arrays and objects over {MAX_JSON_DEPTH} "
                       "deep)", param="body")
    return body


def engine_error(exc: Exception) -> ApiError:
    """A refused or failed engine request as an API error (the engine's message names the field): the
    worker died (503 `engine_dead`), it failed to handle this request alone (500 `request_failed`), or
    it refused the request's input (400)."""
    if isinstance(exc, EngineDeadError):
        return ApiError(503, f"engine unavailable: {exc}", type="server_error", code="engine_dead")
    if isinstance(exc, RequestFailedError):
        return ApiError(500, str(exc), type="server_error", code="request_failed")
    return named_error(str(exc))
