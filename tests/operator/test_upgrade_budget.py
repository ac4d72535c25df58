"""The engine-image upgrade budget (operator/upgrade.py) as the reconciler asks it: which services are upgrades in
flight under --max-concurrent-upgrades."""

from __future__ import annotations

from shoal.operator import upgrade

OLD, NEW = "registry.test/shoal-engine:1", "registry.test/shoal-engine:2"


def isvc(image: str, *, rolling: bool, ready: bool = False, upgrading: bool = False) -> dict:
    conditions = [{"type": "Ready", "status": "True" if ready else "False", "reason": "PodsPending"},
                  {"type": "Progressing", "status": "True" if rolling else "False",
                   "reason": "RollingOut" if rolling else "RolloutComplete"}]
    if upgrading:
        conditions.append({"type": upgrade.CONDITION, "status": "True", "reason": "MovingToDefault"})
    return {"metadata": {"name": "x", "namespace": "ns"}, "spec": {},
            "status": {"engineImage": image, "conditions": conditions}}


def test_new_services_waiting_for_gpus_are_not_upgrades_in_flight():
    """A new service is pinned to the default at once and rolls out its first pods, perhaps for hours while it
    waits for GPUs: it must not hold an upgrade slot, or such services block every engine-image upgrade."""
    fleet = {("ns", f"new-{i}"): isvc(NEW, rolling=True) for i in range(3)}
    fleet[("ns", "old")] = isvc(OLD, rolling=False, ready=True)
    upgrades = upgrade.Upgrades()
    assert upgrades.in_flight(fleet.items(), NEW) == 0
    pinned, started = upgrades.pin(("ns", "old"), fleet[("ns", "old")], NEW, None, 1, fleet.items())
    assert (pinned, started) == (NEW, True)


def test_an_upgrade_another_operator_process_started_holds_its_slot_until_rolled_out():
    moving = isvc(NEW, rolling=True, upgrading=True)
    fleet = {("ns", "moving"): moving, ("ns", "old"): isvc(OLD, rolling=False, ready=True)}
    upgrades = upgrade.Upgrades()  # a fresh process: it started nothing itself
    assert upgrades.in_flight(fleet.items(), NEW) == 1
    assert upgrades.pin(("ns", "old"), fleet[("ns", "old")], NEW, None, 1, fleet.items()) == (OLD, False)
    # its rollout ended: the condition is cleared, and the slot is free
    done = isvc(NEW, rolling=False, ready=True)
    assert upgrades.condition(("ns", "moving"), False, moving["status"], done["status"], NEW)[:2] == (False,
                                                                                                       "Completed")
    # the pass that starts a move sets it
    assert upgrades.condition(("ns", "old"), True, {}, {}, NEW)[0] is True
