"""Which operator replica leads, as kopf's peering decides it — for the work kopf's handlers do not run.

With several operator replicas (the chart's highAvailability) kopf's peering lets exactly one process events: each
replica writes a keep-alive into the peering object's status (`{identity: {priority, lastseen, lifetime}}`), and a
replica that sees a live peer with a higher priority pauses — as does every replica when two share one. kopf offers
no hook for that state besides daemons and timers, which put a finalizer on every object they serve (so that
deleting a service hangs once the operator is uninstalled); the autoscaler is therefore a task of its own, and it
asks this module, which applies the same rule to the same peering object through its own watch:

  leading  <=>  standalone, or: every peering object of ours holds exactly one live entry with our priority (our
                own keep-alive) and none with a higher one (and, when peering is only auto-detected, there is
                no peering object of ours at all).

An operator that cannot renew its own keep-alive (cut off from the API server) sees its entry expire after its
lifetime and stops leading at the moment a standby may start: the two never scale at once for longer than clocks
disagree (and the autoscaler's writes carry a resourceVersion, so a decision made on a stale view is refused).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Iterable


def _parse_time(text: str) -> datetime.datetime | None:
    try:
        t = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except (ValueError, AttributeError):
        return None
    return t if t.tzinfo else t.replace(tzinfo=datetime.timezone.utc)


@dataclass(frozen=True)
class Peer:
    priority: int
    deadline: datetime.datetime


def peers(peering: dict[str, Any]) -> list[Peer]:
    """The keep-alives in a kopf peering object's status (an entry being removed is null)."""
    found = []
    for entry in ((peering.get("status") or {}).values()):
        if not isinstance(entry, dict):
            continue
        seen = _parse_time(str(entry.get("lastseen", "")))
        if seen is None:
            continue
        try:
            found.append(Peer(int(entry.get("priority", 0)), seen + datetime.timedelta(
                seconds=int(entry.get("lifetime", 60)))))
        except (TypeError, ValueError):
            continue
    return found


@dataclass(frozen=True)
class Leadership:
    standalone: bool = True
    peering_name: str | None = None
    priority: int = 0
    mandatory: bool = True  # kopf's --peering NAME; without it kopf runs unpaused while no peering object exists

    def leading(self, peerings: Iterable[dict[str, Any]], now: datetime.datetime | None = None) -> bool:
        """Whether this replica leads, given the peering objects it watches (ours are those named peering_name)."""
        if self.standalone:
            return True
        now = now or datetime.datetime.now(datetime.timezone.utc)
        ours = [p for p in peerings if (p.get("metadata") or {}).get("name") == self.peering_name]
        if not ours:  # kopf stays paused without its peering object, unless peering was only auto-detected
            return not self.mandatory
        for peering in ours:
            live = [p for p in peers(peering) if p.deadline > now]
            if any(p.priority > self.priority for p in live):
                return False
            if sum(1 for p in live if p.priority == self.priority) != 1:  # ours missing or expired, or a twin
                return False
        return True
