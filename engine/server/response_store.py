"""Stored responses for `previous_response_id` and GET/DELETE /v1/responses/{id}: bounded in count, expiring, and
owned by the tenant a gateway named (gateway_contract.TENANT_HEADER) or else the API key that created them (another
owner, or no key, never sees them: it gets the same 404 as for an id that never existed). In memory, per engine
process: a restart forgets them, and another replica never had them — the ids carry this process's tag
(`instance`), by which the gateways send every request about one of them here (gateway_contract.py).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from shoal.engine.server.gateway_contract import TENANT_HEADER, new_instance_tag


@dataclass
class StoredResponse:
    owner: str
    response: dict  # the Response object as it was returned
    conversation: list[dict]  # every input item of every turn so far, then this response's output items
    expires: float = field(default=0.0)


def owner_of(headers) -> str:
    """Who a request is, for the store: the tenant a gateway named, else a digest of the key it presented (Bearer
    or X-API-Key); "" for none. The tenant header is believed as the request is: on an engine with a key only
    requests that passed its check get here, and behind the shared gateway that key is the gateway's (tenants never
    see it). The two kinds of owner never collide: a digest is hex, a tenant owner starts with "tenant:"."""
    tenant = headers.get(TENANT_HEADER, "").strip()
    if tenant:
        return f"tenant:{tenant}"
    given = headers.get("Authorization", "")
    token = given[7:].strip() if given[:7].lower() == "bearer " else headers.get("X-API-Key", "")
    return hashlib.sha256(token.encode()).hexdigest() if token else ""


class ResponseStore:
    def __init__(self, max_entries: int = 1000, ttl_s: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic, instance: str | None = None):
        if max_entries < 1 or ttl_s <= 0:
            raise ValueError("the response store needs max_entries >= 1 and ttl_s > 0")
        self.max_entries, self.ttl_s, self.clock = max_entries, ttl_s, clock
        self.instance = instance or new_instance_tag()  # in every id issued here; /readyz says it
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        now = self.clock()
        entry.expires = now + self.ttl_s
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        # Every entry has the same lifetime, so the expired ones are at the front.
        while self._entries:
            oldest_id, oldest = next(iter(self._entries.items()))
            if oldest.expires > now and len(self._entries) <= self.max_entries:
                break
            del self._entries[oldest_id]

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        if entry.expires <= self.clock():
            del self._entries[response_id]
            return None
        return entry

    def delete(self, owner: str, response_id: str) -> bool:
        if self.get(owner, response_id) is None:
            return False
        del self._entries[response_id]
        return True
