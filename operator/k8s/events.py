"""How the operator posts a Kubernetes Event on an object: one body, one POST (best effort)."""

from __future__ import annotations

import asyncio
import datetime
import logging
from typing import Any

import aiohttp

from shoal.operator.k8s.client import ApiError, Client, collection_path

logger = logging.getLogger("shoal.operator.events")

COMPONENT = "shoal-operator"


def event_body(involved: dict[str, Any], type_: str, reason: str, message: str,
               now: datetime.datetime | None = None) -> dict[str, Any]:
    """A core/v1 Event about `involved` (an object with apiVersion, kind, metadata name/namespace/uid)."""
    meta = involved["metadata"]
    stamp = (now or datetime.datetime.now(datetime.timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": involved["apiVersion"], "kind": involved["kind"], "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta.get("uid")},
            "type": type_, "reason": reason, "message": message[:1024],
            "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
            "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1}


async def post_event(client: Client, involved: dict[str, Any], type_: str, reason: str, message: str) -> None:
    """Post it; a refusal is logged, never raised (an Event is not worth a failed reconcile or decision)."""
    body = event_body(involved, type_, reason, message)
    try:
        await client.create(collection_path("v1", "events", body["metadata"]["namespace"]), body)
    except (ApiError, aiohttp.ClientError, asyncio.TimeoutError) as e:
        logger.info("event %s on %s/%s not posted: %r", reason, body["metadata"]["namespace"],
                    involved["metadata"]["name"], e)
