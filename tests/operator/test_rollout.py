"""rollout.step: the next moves of a multi-pod rollout, from what is observed."""

from __future__ import annotations

import pytest

from shoal.operator import rollout
from shoal.operator.status import Group


def g(index: int, current: bool, ready: bool) -> Group:
    return Group(index=index, revision="new" if current else "old", current=current, ready=ready,
                 updated=current and ready)


def test_surge_then_retire_with_one_replica():
    s = rollout.step([g(0, False, True)], 1, 1, 0)
    assert (s.create, s.retire, s.update) == ([1], [], [])
    s = rollout.step([g(0, False, True), g(1, True, False)], 1, 1, 0)  # new group still loading: wait
    assert (s.create, s.retire, s.update) == ([], [], [])
    s = rollout.step([g(0, False, True), g(1, True, True)], 1, 1, 0)
    assert (s.create, s.retire, s.update) == ([], [0], [])


def test_max_surge_zero_replaces_in_place_within_the_budget():
    s = rollout.step([g(0, False, True), g(1, False, True)], 2, 0, 1)
    assert (s.create, s.retire, s.update) == ([], [], [0])
    s = rollout.step([g(0, True, False), g(1, False, True)], 2, 0, 1)  # group 0 restarting: 1 may not go
    assert (s.create, s.retire, s.update) == ([], [], [])
    s = rollout.step([g(0, True, True), g(1, False, True)], 2, 0, 1)
    assert s.update == [1]


def test_unready_outdated_groups_go_first_and_scale_down_drops_surplus():
    s = rollout.step([g(0, False, False), g(1, False, True)], 2, 1, 0)
    assert s.create == [2]
    s = rollout.step([g(0, False, False), g(1, False, True), g(2, True, False)], 2, 1, 0)
    assert s.retire == [0] and s.create == [3]
    s = rollout.step([g(0, True, True), g(1, True, False), g(2, True, True)], 1, 1, 0)
    assert sorted(s.retire) == [1, 2] and not s.create


@pytest.mark.parametrize("surge,unavailable,replicas,want", [
    ("25%", "25%", 4, (1, 1)), ("10%", "10%", 4, (1, 0)), (0, "10%", 4, (0, 1)), (2, 0, 1, (2, 0))])
def test_budgets_round_like_a_deployment(surge, unavailable, replicas, want):
    assert rollout.budgets(replicas, surge, unavailable) == want
