"""Rollouts of multi-pod replicas (groups), honouring spec.rollout like a Deployment or a LeaderWorkerSet.

A group is one StatefulSet ``<name>-g<index>`` (plus its headless Service) whose pods form one torch.distributed
job. Its *revision* is the annotation ``serving.shoal.dev/revision`` on the StatefulSet: a hash of everything the
spec puts into a group, independent of the index. A spec change (or a new default engine image) makes every
group outdated; ``step()`` decides, from what is observed now, the next moves towards ``replicas`` ready groups on
the new revision, never going below ``replicas - maxUnavailable`` ready groups nor above ``replicas + maxSurge``
groups:

* surge: create a group on the new revision at the lowest free index, wait until all its ranks are Ready, then
  retire an outdated group (delete its StatefulSet; its pods drain on SIGTERM);
* ``maxSurge: 0``: update an outdated group in place (new template, its pods restarted together) when the
  unavailability budget allows it;
* scale down: retire surplus groups, unready ones and the highest indexes first.

Percentages resolve like a Deployment's: maxSurge rounds up, maxUnavailable down; both zero means one
unavailable (else nothing could move). Pure functions, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shoal.operator.status import Group


@dataclass
class Step:
    create: list[int] = field(default_factory=list)  # new groups at the desired revision
    retire: list[int] = field(default_factory=list)  # groups to delete
    update: list[int] = field(default_factory=list)  # outdated groups replaced in place (maxSurge 0)


def resolve(value: int | str, replicas: int, round_up: bool) -> int:
    if isinstance(value, int):
        return value
    fraction = int(value.rstrip("%")) * replicas / 100
    return math.ceil(fraction) if round_up else math.floor(fraction)


def budgets(replicas: int, max_surge: int | str, max_unavailable: int | str) -> tuple[int, int]:
    surge = resolve(max_surge, replicas, round_up=True)
    unavailable = resolve(max_unavailable, replicas, round_up=False)
    if surge == 0 and unavailable == 0:
        unavailable = 1
    return surge, unavailable


def step(groups: list[Group], replicas: int, max_surge: int | str, max_unavailable: int | str) -> Step:
    surge, unavailable = budgets(replicas, max_surge, max_unavailable)
    min_ready, max_total = replicas - unavailable, replicas + surge
    out = Step()
    new = [g for g in groups if g.current]
    old = [g for g in groups if not g.current]
    total = len(groups)
    ready = sum(g.ready for g in groups)

    def retire(g: Group) -> None:
        nonlocal total, ready
        out.retire.append(g.index)
        total -= 1
        ready -= g.ready

    # surplus groups on the new revision (scaled down): unready and highest indexes first
    for g in sorted(new, key=lambda g: (g.ready, -g.index))[:max(0, len(new) - replicas)]:
        new.remove(g)
        retire(g)
    # outdated groups go once there is a surplus and availability allows it; unready ones first
    for g in sorted(old, key=lambda g: (g.ready, -g.index)):
        if total > replicas and (not g.ready or ready - 1 >= min_ready):
            old.remove(g)
            retire(g)
    # new groups up to replicas, within the surge budget
    used = {g.index for g in groups}
    free = (i for i in range(replicas + surge + len(groups) + 1) if i not in used)
    for _ in range(max(0, min(replicas - len(new), max_total - total))):
        out.create.append(next(free))
        total += 1
    # no room to surge: replace outdated groups in place within the unavailability budget
    if len(new) + len(out.create) < replicas:
        for g in sorted(old, key=lambda g: (g.ready, g.index)):
            if len(new) + len(out.create) + len(out.update) >= replicas:
                break
            if not g.ready or ready - 1 >= min_ready:
                out.update.append(g.index)
                ready -= g.ready
    return out
