"""Which default engine image an InferenceService runs: pinned in its status, so that a new operator version (a new
--engine-image) does not roll every GPU fleet at once.

A service without `spec.image` runs `status.engineImage`. A new service is pinned to the operator's default; one
created before pinning existed is pinned to the image its workload already runs (read only from a workload no
pinning operator rendered: never from one this operator just rendered, whose status write may not be visible yet,
nor from a non-Shoal runtime's engine container). When the default changes, a service moves to it (a rollout) only while fewer than `--max-concurrent-upgrades` services are in such a rollout, or at once
when it carries the annotation `serving.shoal.dev/upgrade-engine-image` (any value: an explicit upgrade, outside the
budget); the others keep their pinned image until their turn. A rollout that never completes (a bad image) keeps
holding its slot, so a broken image stops at the budget instead of reaching the whole fleet. Pure functions; the
reconciler keeps the set of upgrades it started (``Upgrades``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from shoal.operator.contract import A_UPGRADE  # noqa: E402

# The condition a service carries while it moves to a new default image (True from the pass that starts the move
# until its rollout has ended): how an operator process tells an upgrade in flight, which another process may have
# started, from a new service that is merely rolling out its first pods (waiting for GPUs, say), which is no upgrade.
CONDITION = "EngineImageUpgrading"


def asked(isvc: dict[str, Any]) -> bool:
    """Does the service ask to move to the default image now (explicit upgrade, outside the budget)?"""
    return A_UPGRADE in (isvc["metadata"].get("annotations") or {})


def upgrading(isvc: dict[str, Any]) -> bool:
    """Does the service's status say it is moving to a new default engine image (CONDITION)?"""
    return any(c.get("type") == CONDITION and c.get("status") == "True"
               for c in (isvc.get("status") or {}).get("conditions") or [])


def rolling_out(isvc: dict[str, Any]) -> bool:
    """Is the service rolling out a new pod template (its Progressing condition says RollingOut)?"""
    return any(c.get("type") == "Progressing" and c.get("status") == "True" and c.get("reason") == "RollingOut"
               for c in (isvc.get("status") or {}).get("conditions") or [])


# On every workload a pinning operator renders: the default engine image it rendered with. Its only reader is
# `workload_image`, which must never take a pin from such a workload: the pin lives in the status, and a reconcile
# that reads the service before its own status write is visible would otherwise pin what it just rendered.
A_RENDERED_IMAGE = "serving.shoal.dev/default-engine-image"
# containers that ran Shoal's engine image whatever the runtime in workloads rendered before pinning (the helpers
# were `shoal-engine download` / `sync-adapters` then)
SHOAL_HELPERS = ("model-download", "adapter-sync")


def workload_image(observed: dict[tuple[str, str], dict[str, Any]], runtime: str = "shoal") -> str | None:
    """The default engine image the service's workload runs now, for a service created before pinning existed
    (a Deployment's or a group StatefulSet's template): a Shoal helper container's image, or the engine's when the
    runtime is Shoal's. None when an operator that pins rendered the workload (its status holds the pin)."""
    for (kind, _), obj in sorted(observed.items()):
        if kind not in ("Deployment", "StatefulSet"):
            continue
        if A_RENDERED_IMAGE in ((obj.get("metadata") or {}).get("annotations") or {}):
            return None
        pod = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
        containers = [*(pod.get("initContainers") or []), *(pod.get("containers") or [])]
        for c in containers:
            if c.get("image") and (c.get("name") in SHOAL_HELPERS or (c.get("name") == "engine" and
                                                                      runtime == "shoal")):
                return c["image"]
    return None


@dataclass
class Upgrades:
    """Upgrades this operator started, until their rollout was seen and has ended."""

    started: dict[tuple[str, str], bool] = field(default_factory=dict)  # key -> rollout seen yet
    # moved to the default in this process and no longer rolling out, or moved on request (the index may lag)
    moved: set[tuple[str, str]] = field(default_factory=set)

    def in_flight(self, isvcs: Iterable[tuple[tuple[str, str], dict[str, Any]]], default: str) -> int:
        """Services rolling out to the default image now: those this operator moved (until their rollout ended)
        and any other pinned to it, rolling out and marked as upgrading (moved by a previous operator process).
        A service that never ran another image (a new one, still waiting for its first pods) is no upgrade."""
        current = dict(isvcs)
        count = 0
        for key, seen in list(self.started.items()):
            isvc = current.get(key)
            if isvc is None:
                del self.started[key]
            elif rolling_out(isvc):
                self.started[key] = True
            elif seen:
                del self.started[key]
                self.moved.add(key)
        for key, isvc in current.items():
            if key not in self.started and key not in self.moved and not asked(isvc) and rolling_out(isvc) and \
                    upgrading(isvc) and (isvc.get("status") or {}).get("engineImage") == default:
                count += 1
        return count + len(self.started)

    def observe(self, key: tuple[str, str], new_status: dict[str, Any]) -> bool:
        """The status just computed for a service: -> whether an upgrade of it ended (a slot is free)."""
        if key not in self.started:
            return False
        if rolling_out({"status": new_status}):
            self.started[key] = True
            return False
        if self.started[key]:
            del self.started[key]
            self.moved.add(key)
            return True
        return False

    def condition(self, key: tuple[str, str], started: bool, previous: dict[str, Any], new_status: dict[str, Any],
                  default: str) -> tuple[bool, str, str] | None:
        """CONDITION for the status just computed: (ok, reason, message), or None to leave it as it is."""
        if started:
            return True, "MovingToDefault", f"moving to the operator's engine image {default}"
        if upgrading({"status": previous}) and key not in self.started and not rolling_out({"status": new_status}):
            return False, "Completed", f"runs the operator's engine image {new_status.get('engineImage') or default}"
        return None

    def pin(self, key: tuple[str, str], isvc: dict[str, Any], default: str, observed_image: str | None,
            budget: int, isvcs: Iterable[tuple[tuple[str, str], dict[str, Any]]]) -> tuple[str | None, bool]:
        """-> (the engine image to pin in the status, None with spec.image; whether this starts an upgrade)."""
        if (isvc.get("spec") or {}).get("image"):
            return None, False
        if key in self.started or key in self.moved:  # moved already (its status may not show it yet)
            return default, False
        pinned = (isvc.get("status") or {}).get("engineImage") or observed_image or default
        if pinned == default:
            return default, False
        if asked(isvc):  # the user's explicit upgrade: outside the budget
            self.moved.add(key)
            return default, True
        if self.in_flight(isvcs, default) < budget:
            self.started[key] = False
            return default, True
        return pinned, False
