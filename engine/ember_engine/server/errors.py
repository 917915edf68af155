"""OpenAI-shaped errors: the JSON response for an `APIError`, the handlers that turn FastAPI's own
errors (validation, malformed JSON) into one, the error of a request past its deadline, and that of a
request the engine could not finish because it failed for good."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ember_engine.async_engine import EngineFailed
from ember_engine.server.protocol import APIError


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def add_error_handlers(app: FastAPI) -> None:
    """Answer an `APIError`, and a request FastAPI could not validate, with an OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        # FastAPI's own errors: an unknown route, a wrong method, a body it could not decode or parse
        # (invalid UTF-8, nesting deeper than the parser's recursion).
        message = str(exc.detail)
        if exc.__cause__ is not None:
            message = f"body: {message}: {type(exc.__cause__).__name__}: {exc.__cause__}"[:500]
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = APIError(exc.status_code, message, type=kind, headers=dict(exc.headers or {}))
        return _error_response(err)

    @app.exception_handler(EngineFailed)
    async def _engine_failed(_: Request, exc: EngineFailed) -> JSONResponse:
        return _error_response(engine_failed(exc))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # A fault of the server's, not the request's (the traceback is logged): still an OpenAI body.
        return _error_response(internal_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return _error_response(APIError(400, f"body: malformed JSON ({first.get('msg')})"))
        param = _field(first.get("loc", ()))
        msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        # A field of several types fails once per type: one message, each type's reason after the first.
        others = [e for e in exc.errors()[1:] if _field(e.get("loc", ())) == param and param is not None]
        for reason in dict.fromkeys(str(e.get("msg", "")).removeprefix("Input should be ") for e in others):
            msg += ", or " + reason
        if (
            param is None and first.get("type") == "value_error" and ": " in msg
        ):  # a whole-body check names the field itself
            param = msg.split(": ", 1)[0]
            return _error_response(APIError(400, msg, param=param))
        return _error_response(APIError(400, f"{param or 'body'}: {msg}", param=param))


# pydantic's names for the members of a union in an error's location ("str", "list[int]",
# "function-after[...]"): no field of the request is named so.
_TYPE_TAG = re.compile(r"^(?:str|int|float|bool|none|bytes|constrained-\w+|[a-z-]+\[.*\])$")


def _field(loc: Sequence[Any]) -> str | None:
    """The request field an error's location names, without "body" and the union members' tags."""
    return ".".join(str(p) for p in loc if p != "body" and not _TYPE_TAG.match(str(p))) or None


def internal_error(exc: Exception) -> APIError:
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}"[:500], type="internal_server_error")


# What a client is told of a failure is its cause without gloo's source locations and advice.
_SOURCE = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|h|hpp|c):\d+\]\s*")
_ADVICE = re.compile(r"\.? This is typically caused by .*", re.DOTALL)


def still_loading(retry_after_s: int) -> APIError:
    """What an endpoint that needs the model answers while it loads, as the completions endpoints shed."""
    return APIError(
        503,
        "the model is still loading",
        type="overloaded",
        code="not_ready",
        headers={"Retry-After": str(retry_after_s)},
    )


def engine_failed(exc: EngineFailed) -> APIError:
    """The engine stopped for good (a tensor-parallel rank was lost; the server exits and its pod
    restarts) before finishing the request: a 503 to send it again, elsewhere or once restarted (a
    stream already begun gets its body as an error event)."""
    cause = _ADVICE.sub("", _SOURCE.sub("", str(exc.cause)))
    return APIError(
        503,
        f"the engine failed and is restarting ({cause}); send the request again"[:500],
        type="unavailable",
        code="engine_failed",
        headers={"Retry-After": "1"},
    )


def _timeout_error(deadline: float) -> APIError:
    return APIError(
        504,
        f"the request did not finish within its deadline of {deadline:g} s and was aborted",
        type="timeout",
        code="deadline_exceeded",
    )
