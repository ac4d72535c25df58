"""What the engines and the gateways agree on beyond the routes themselves (standard library only: the gateways
import it): how stored responses are found and owned, and Anthropic's error body.

A stored response lives in the memory of the one engine process that made it. So that any gateway replica can send
`previous_response_id` and GET/DELETE /v1/responses/{id} there without a shared map, the engine puts an opaque tag
of its own in every id it issues (`resp_<tag><32 hex>`), random per process, and says it on /readyz
(`"instance"`), which every gateway already polls. The tag is no address: a client learns nothing from it. An id
whose tag no engine of the pool has now (the engine restarted or went away, or the id was made up) is answered
exactly as an unknown id is, by the gateway itself.

Behind the shared gateway every tenant reaches an engine with the engines' own key, so the gateway names the tenant
in TENANT_HEADER; the engine believes it only on a request that passed its key check (or on an engine that checks
no key, which believes every caller), and keys the store's ownership by it.

Errors on Anthropic's routes (/v1/messages...) are in Anthropic's shape, whether the engine or a gateway makes them:
its clients parse no other.
"""

from __future__ import annotations

import re
import secrets
import uuid

TENANT_HEADER = "X-Shoal-Tenant"
_TAG_HEX = 12
_ID = re.compile(rf"resp_([0-9a-f]{{{_TAG_HEX}}})[0-9a-f]{{32}}")
RESPONSE_PATH = "/v1/responses/"  # GET/DELETE /v1/responses/{id}


def new_instance_tag() -> str:
    return secrets.token_hex(_TAG_HEX // 2)


def response_id(instance: str) -> str:
    return f"resp_{instance}{uuid.uuid4().hex}"


def instance_of(response_id: object) -> str | None:
    """The engine tag of an id this project's engines issued; None for anything else."""
    m = _ID.fullmatch(response_id) if isinstance(response_id, str) else None
    return m.group(1) if m else None


def not_found_error(response_id: str) -> dict:
    """OpenAI's body for GET/DELETE of an unknown, expired, deleted or another owner's id."""
    return {"message": f"response {response_id!r} not found", "type": "invalid_request_error",
            "param": "response_id", "code": "not_found"}


def previous_not_found_error(response_id: str) -> dict:
    """The same for `previous_response_id`."""
    return {"message": f"previous response {response_id!r} not found (unknown, expired, deleted or stored under "
                       "another API key)", "type": "invalid_request_error", "param": "previous_response_id",
            "code": "previous_response_not_found"}


ANTHROPIC_PREFIX = "/v1/messages"
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                         413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                         503: "overloaded_error", 504: "timeout_error"}


def anthropic_error(status: int, message: str) -> dict:
    """Anthropic's error body: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500
                                                                         else "invalid_request_error"),
                                       "message": message}}
