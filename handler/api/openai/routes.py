"""The OpenAI-compatible API's routes, its error answers and the model list.

TorchServe 0.12 hands the path segments after `/predictions/{model}/{version}/`
to the handler in the `url_path` request header ("" on the native route), so a
client uses `base_url = http://HOST:8080/predictions/{model}/{version}/v1`.

TorchServe passes every method on that path through, and the request's headers,
but not the method itself: GET, POST and DELETE reach the handler alike. Where
the method matters (`v1/responses/{id}`: GET retrieves, DELETE deletes) the
headers tell a delete apart (`asks_to_delete`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Mapping

from handler.schema import RequestError

ROUTE_NATIVE = "native"
ROUTE_COMPLETIONS = "completions"
ROUTE_CHAT = "chat"
ROUTE_RESPONSES = "responses"  # handler.api.openai.responses: translated into a chat request
ROUTE_MODELS = "models"
ROUTE_MODEL = "model"  # GET v1/models/{id}
ROUTE_RESPONSE = "response"  # GET or DELETE v1/responses/{id}: a stored response
ROUTE_UNKNOWN = "unknown"
PATHS = {
    "v1/completions": ROUTE_COMPLETIONS,
    "v1/chat/completions": ROUTE_CHAT,
    "v1/responses": ROUTE_RESPONSES,
    "v1/models": ROUTE_MODELS,
}

OWNED_BY = "torchserve"
# The header that names the method where the frontend does not pass it on (Google's APIs take it too).
METHOD_OVERRIDE_HEADER = "x-http-method-override"
# Every request of OpenAI's SDKs (Python, Node: Stainless-generated) carries it.
SDK_HEADER = "x-stainless-lang"


@dataclasses.dataclass(frozen=True)
class Route:
    """Where a request goes: `kind` is one of the ROUTE_* names; `path` is the normalised url_path."""

    kind: str
    path: str = ""
    model_id: str | None = None  # for ROUTE_MODEL
    response_id: str | None = None  # for ROUTE_RESPONSE
    delete: bool = False  # ROUTE_RESPONSE: delete it, else retrieve it (`asks_to_delete`)

    @property
    def is_openai(self) -> bool:
        return self.kind != ROUTE_NATIVE


def route_from_url_path(url_path: str | None, headers: Mapping | None = None) -> Route:
    """Maps TorchServe's `url_path` header to a route.

    Args:
        url_path: the path after `/predictions/{model}/{version}/`: "" or None on
            the native route (older TorchServe versions send no header).
        headers: the request's HTTP headers, for `v1/responses/{id}` (`asks_to_delete`).
    Returns:
        The route; empty segments are dropped, so `v1//models/` is `v1/models`.
    """
    segments = [segment for segment in (url_path or "").split("/") if segment]
    path = "/".join(segments)
    if not segments:
        return Route(ROUTE_NATIVE)
    if path in PATHS:
        return Route(PATHS[path], path)
    if len(segments) == 3 and segments[:2] == ["v1", "models"]:
        return Route(ROUTE_MODEL, path, model_id=segments[2])
    if len(segments) == 3 and segments[:2] == ["v1", "responses"]:
        return Route(ROUTE_RESPONSE, path, response_id=segments[2], delete=asks_to_delete(headers or {}))
    return Route(ROUTE_UNKNOWN, path)


def asks_to_delete(headers: Mapping) -> bool:
    """Whether a request on `v1/responses/{id}` is a DELETE, which TorchServe does not say.

    `X-HTTP-Method-Override: DELETE` says so, from any client. OpenAI's SDKs say it their own way:
    their `responses.delete` accepts `*/*` and their `responses.retrieve` JSON only. Anything else
    is a retrieval, which changes nothing.
    """
    lower = {str(key).lower(): value for key, value in headers.items() if isinstance(value, str)}
    if lower.get(METHOD_OVERRIDE_HEADER, "").strip().upper() == "DELETE":
        return True
    return SDK_HEADER in lower and lower.get("accept", "").strip() == "*/*"


_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]/]*): ")
_NOT_PARAMS = ("body", "server", "url")
# A 404's code, by the field that named what is missing (OpenAI's codes; a stored response's has none).
NOT_FOUND_CODES = {
    "model": "model_not_found",
    "previous_response_id": "previous_response_not_found",
    "response_id": None,
}


def error_answer(error: RequestError) -> tuple[int, dict]:
    """The HTTP status and OpenAI error body for a refused or failed request.

    The param is the field the message starts with. A prompt too long for the
    context is a 400 with code `context_length_exceeded`, as OpenAI answers it
    (the native route says 413).
    """
    message = str(error)
    match = _FIELD_PREFIX.match(message)
    param = match.group(1) if match and match.group(1) not in _NOT_PARAMS else None
    status, code = error.status, None
    if status == 413:
        status, code = 400, "context_length_exceeded"
    elif status == 404 and param in NOT_FOUND_CODES:
        code = NOT_FOUND_CODES[param]
    elif status == 404 and param is None:
        code = "unknown_url"
    kind = "invalid_request_error" if status < 500 else "server_error"
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


def unknown_route_error(route: Route) -> RequestError:
    return RequestError(
        f"url: no route /{route.path}; this server has /v1/completions, /v1/chat/completions, /v1/responses, "
        "/v1/responses/{id} and /v1/models",
        status=404,
    )


def model_card(model_name: str, created: int) -> dict:
    return {"id": model_name, "object": "model", "created": created, "owned_by": OWNED_BY}


def models_answer(route: Route, model_name: str, created: int) -> dict:
    """GET v1/models (a list with this model) or v1/models/{id}; raises a 404 RequestError for another id."""
    if route.kind == ROUTE_MODELS:
        return {"object": "list", "data": [model_card(model_name, created)]}
    assert route.kind == ROUTE_MODEL
    if route.model_id != model_name:
        raise RequestError(
            f"model: the model {json.dumps(route.model_id)} does not exist; this endpoint serves "
            f"{json.dumps(model_name)}",
            status=404,
        )
    return model_card(model_name, created)
