"""Canary revisions (spec.canary): what the reconciler needs to know of them, without I/O.

The flow (docs/api.md, "Canary revisions"):

* spec.canary holds a second revision — model, image, engine options over the stable spec's — which runs as its
  own Deployment `<name>-canary` (pods labelled serving.shoal.dev/canary=true) behind the same engines Service;
  the gateway sends it `trafficPercent` % of the conversations (sticky per conversation, gateway/canary.py);
* the operator judges the canary on what the gateways measure per revision (canary_judge.py) against
  spec.canary.rollback; a breach writes status.canary.rollback with the canary's revision: from then on the canary
  gets no traffic and its Deployment is removed, until its revision changes (a new model, image or engine option)
  or spec.canary is removed — the user's manifest is never rewritten behind a GitOps tool's back;
* `promote: true` is the one spec change the operator makes for the user: the canary's fields are written into
  spec.model/image/engine and spec.canary is removed, in one patch on the version it read; the stable Deployment
  then rolls to the new template (rollout.maxSurge/maxUnavailable) and the canary Deployment is removed.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from shoal.operator import api

CONDITION_ROLLED_BACK = "CanaryRolledBack"
CONDITION_READY = "CanaryReady"


def revision(spec: api.InferenceServiceSpec) -> str:
    """The canary's revision: a hash of what makes it a different server (model, image, engine options) — not its
    traffic share, replicas or SLO, which change without making it another canary."""
    c = spec.canary
    assert c is not None
    what = {"model": c.model.model_dump(mode="json", exclude_none=True) if c.model else None, "image": c.image,
            "engine": c.engine.model_dump(mode="json", exclude_none=True) if c.engine else None}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]


def rolled_back(spec: api.InferenceServiceSpec, status: dict[str, Any] | None) -> bool:
    """Was this revision of the canary rolled back (status.canary.rollback names it)?"""
    if spec.canary is None:
        return False
    done = (((status or {}).get("canary") or {}).get("rollback") or {}).get("revision")
    return done == revision(spec)


def traffic_percent(spec: api.InferenceServiceSpec, status: dict[str, Any] | None) -> int:
    """The canary's share the gateways apply: spec.canary.trafficPercent, 0 once rolled back (or without one)."""
    if spec.canary is None or rolled_back(spec, status):
        return 0
    return spec.canary.traffic_percent


def split(percent: int) -> str:
    """`kubectl get isvc`'s Split column: stable/canary percentages."""
    return f"{100 - percent}/{percent}"


def promoted_spec(raw: dict[str, Any]) -> dict[str, Any]:
    """The spec after promotion (a merge patch's body): the canary's model, image and engine fields written over
    the stable ones, spec.canary removed. `raw` is the stored spec (camelCase)."""
    canary = raw.get("canary") or {}
    patch: dict[str, Any] = {"canary": None}
    model = canary.get("model") or {}
    if model:
        stable = raw.get("model") or {}
        new_model: dict[str, Any] = {}
        if model.get("uri") is not None and model["uri"] != stable.get("uri"):
            new_model["uri"], new_model["revision"] = model["uri"], None
        for key in ("revision", "servedName"):
            if model.get(key) is not None:
                new_model[key] = model[key]
        if new_model:
            patch["model"] = new_model
    if canary.get("image") is not None:
        patch["image"] = canary["image"]
    engine = {k: v for k, v in (canary.get("engine") or {}).items() if v is not None}
    if engine:
        patch["engine"] = engine
    return patch


def canary_pod(pod: dict[str, Any]) -> bool:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(api.contract.L_CANARY) == "true"
