"""The autoscaling decision on load traces (ramp, spike, idle, slow model loads), one decision per second.

`Fleet` replays a trace the way the operator sees it: every second the load (concurrent requests, as closed-loop
chat clients produce it) is spread over the ready replicas (or held by the gateway while none is ready), the
decision runs, and replicas the decision added become ready `load_seconds` later (removed ones go at once).
"""

from __future__ import annotations

import math

import pytest

from shoal.operator.autoscaling import (History, Observation, Parking, Policy, ReplicaLoad, decide, park,
                                        pick_victims)


class Fleet:
    def __init__(self, policy: Policy, replicas: int, load_seconds: float = 0.0, kv_per_request: float = 0.0):
        self.policy = policy
        self.history = History()
        self.load_seconds = load_seconds
        self.kv_per_request = kv_per_request
        self.ready_at: list[float] = [0.0] * replicas  # when each replica is (or was) ready
        self.log: list[tuple[float, int, int, str]] = []  # (t, load, desired, reason)
        self.removed_while_starting = 0  # replicas that loaded their model for nothing

    @property
    def current(self) -> int:
        return len(self.ready_at)

    def step(self, t: float, load: int) -> int:
        ready = sum(1 for r in self.ready_at if r <= t)
        replicas: tuple[ReplicaLoad, ...] = ()
        held = 0
        if ready:
            share = [load // ready + (1 if i < load % ready else 0) for i in range(ready)]
            replicas = tuple(ReplicaLoad(pod=f"p{i}", running=n, kv_cache_usage=min(1.0, n * self.kv_per_request))
                             for i, n in enumerate(share))
        else:
            held = load
        obs = Observation(now=t, current=self.current, ready=ready, replicas=replicas, held=held)
        decision = decide(obs, self.policy, self.history)
        if decision.desired > self.current:
            self.ready_at += [t + self.load_seconds] * (decision.desired - self.current)
        elif decision.desired < self.current:
            by_age = sorted(self.ready_at)  # starting ones go first
            self.removed_while_starting += sum(1 for r in by_age[decision.desired:] if r > t)
            self.ready_at = by_age[:decision.desired]
        self.log.append((t, load, decision.desired, decision.reason))
        return decision.desired

    def run(self, trace: list[tuple[float, int]], until: float, t0: float = 0.0) -> list[int]:
        """trace: (from_time, load) steps; one decision per second from t0 to until."""
        out = []
        t = t0
        while t < until:
            load = [n for start, n in trace if start <= t][-1]
            out.append(self.step(t, load))
            t += 1.0
        return out

    def direction_changes(self) -> list[float]:
        changes, last, prev = [], 0, None
        for t, _load, desired, _ in self.log:
            if prev is not None and desired != prev:
                d = 1 if desired > prev else -1
                if last and d != last:
                    changes.append(t)
                last = d
            prev = desired
        return changes


POLICY = Policy(min_replicas=1, max_replicas=10, target_in_flight=16, scale_up_window=5, scale_down_window=60,
                scale_to_zero_after=120)


def test_ramp_scales_up_to_what_the_load_needs_and_no_further():
    fleet = Fleet(POLICY, replicas=1, load_seconds=20)
    # 0 -> 64 concurrent requests over 60 s, then steady: needs 4 replicas at 16 each
    trace = [(float(t), t + 4) for t in range(61)]
    desired = fleet.run(trace, until=200)
    assert max(desired) == 4 == desired[-1]
    # it followed the ramp (not one jump at the end): 2 and 3 appeared on the way up
    assert {2, 3} <= set(desired[:60])
    assert desired == sorted(desired), "a monotonic ramp never scales down"


def test_slow_model_load_does_not_make_the_recommendation_climb():
    # pods take 3 minutes to load; load steps from 1 to 3 replicas' worth at t=10
    fleet = Fleet(POLICY, replicas=1, load_seconds=180)
    desired = fleet.run([(0.0, 16), (10.0, 48)], until=400)
    assert max(desired) == 3, fleet.log
    assert desired[-1] == 3
    scale_ups = [(t, d, r) for t, _l, d, r in fleet.log if r == "ScaleUp"]
    assert len(scale_ups) == 1, scale_ups  # one decision at t=10+window, nothing more while pods load


def test_spike_shorter_than_the_scale_up_window_adds_nothing():
    fleet = Fleet(POLICY, replicas=1)
    desired = fleet.run([(0.0, 10), (20.0, 100), (23.0, 10)], until=60)
    assert set(desired) == {1}
    # a sustained surge does scale (after the window)
    fleet = Fleet(POLICY, replicas=1)
    desired = fleet.run([(0.0, 10), (20.0, 100)], until=60)
    assert desired[19] == 1 and desired[-1] == math.ceil(100 / 16)
    assert desired.index(7) >= 20 + 4


def test_idle_scales_down_after_the_window_to_min_and_to_zero_after_scale_to_zero_after():
    policy = Policy(min_replicas=0, max_replicas=8, target_in_flight=16, scale_up_window=5, scale_down_window=30,
                    scale_to_zero_after=90)
    fleet = Fleet(policy, replicas=4)
    desired = fleet.run([(0.0, 64), (100.0, 0)], until=300)
    t_down = next(t for t, _l, d, _r in fleet.log if t >= 100 and d < 4)
    assert 100 + 29 <= t_down <= 100 + 31  # the scale-down window after the last busy sample
    assert desired[int(t_down)] == 1  # the last replica stays until idle for scaleToZeroAfter
    t_zero = next(t for t, _l, d, _r in fleet.log if d == 0)
    assert t_zero == 99 + 90  # the last busy sample was at t=99
    assert desired[-1] == 0
    assert "WaitingToScaleToZero" in {r for *_, r in fleet.log}


def test_min_replicas_is_a_floor_even_when_idle():
    fleet = Fleet(Policy(min_replicas=2, max_replicas=5, scale_down_window=10), replicas=5)
    assert fleet.run([(0.0, 0)], until=100)[-1] == 2


def test_from_zero_a_held_request_scales_at_the_first_decision():
    policy = Policy(min_replicas=0, max_replicas=4, scale_up_window=30, scale_down_window=300)
    history = History()
    idle = Observation(now=0.0, current=0, ready=0)
    assert decide(idle, policy, history).desired == 0
    d = decide(Observation(now=1.0, current=0, ready=0, held=1), policy, history)
    assert (d.desired, d.reason) == (1, "ScaleFromZero")
    assert "1 held" in d.message
    # a wake-up from the gateway without a held count yet also counts as load
    d = decide(Observation(now=0.0, current=0, ready=0, wake=True), policy, History())
    assert d.desired == 1
    # many held requests: straight to what they need
    d = decide(Observation(now=0.0, current=0, ready=0, held=40), Policy(min_replicas=0, target_in_flight=16),
               History())
    assert d.desired == 3


def test_a_replica_started_from_zero_is_not_removed_before_it_served():
    policy = Policy(min_replicas=0, max_replicas=2, scale_down_window=1, scale_to_zero_after=2)
    history = History()
    assert decide(Observation(now=0.0, current=0, ready=0, wake=True), policy, history).desired == 1
    # the model loads for a minute; the held request is invisible to the scrape meanwhile
    for t in range(1, 60):
        d = decide(Observation(now=float(t), current=1, ready=0), policy, history)
        assert d.desired == 1, d
    assert d.reason == "WaitingForStartingReplicas"
    # ready, serves, goes idle: then it may go
    decide(Observation(now=60.0, current=1, ready=1, replicas=(ReplicaLoad("p", running=1),)), policy, history)
    ds = [decide(Observation(now=60.0 + t, current=1, ready=1), policy, history).desired for t in range(1, 5)]
    assert ds[-1] == 0


def test_starting_replicas_count_as_capacity():
    policy = Policy(min_replicas=1, max_replicas=10, target_in_flight=10, scale_up_window=0)
    history = History()
    # 3 replicas asked for, 1 ready: 30 in flight is exactly what the 3 will carry -> no more
    loads = (ReplicaLoad("a", running=10, waiting=20),)
    for t in range(30):
        d = decide(Observation(now=float(t), current=3, ready=1, replicas=loads), policy, history)
        assert d.desired == 3, d


def test_kv_cache_signal_scales_when_requests_are_long():
    policy = Policy(min_replicas=1, max_replicas=10, target_in_flight=64, target_kv_cache_usage=0.5,
                    scale_up_window=0)
    loads = tuple(ReplicaLoad(f"p{i}", running=4, kv_cache_usage=0.9) for i in range(2))
    d = decide(Observation(now=0.0, current=2, ready=2, replicas=loads), policy, History())
    assert d.desired == 4 and "KV cache" in d.message


def test_waiting_prefill_tokens_signal_is_used_only_when_targeted():
    loads = (ReplicaLoad("p0", running=1, waiting=1, waiting_prefill_tokens=40000),)
    obs = Observation(now=0.0, current=1, ready=1, replicas=loads)
    assert decide(obs, Policy(scale_up_window=0), History()).desired == 1
    d = decide(obs, Policy(scale_up_window=0, target_waiting_prefill_tokens=8192), History())
    assert d.desired == 5 and "waiting prefill" in d.message


def test_max_replicas_caps_and_says_so():
    fleet = Fleet(Policy(min_replicas=1, max_replicas=3, scale_up_window=0), replicas=1)
    desired = fleet.run([(0.0, 500)], until=5)
    assert max(desired) == 3
    assert fleet.log[-1][3] == "LimitedByMaxReplicas"


def test_load_oscillating_around_a_boundary_changes_direction_at_most_once_per_window():
    policy = Policy(min_replicas=1, max_replicas=10, target_in_flight=16, scale_up_window=10, scale_down_window=30)
    fleet = Fleet(policy, replicas=2)
    # 30 <-> 36 in flight every 7 s: needs 2 or 3 replicas alternately
    trace = [(float(t), 36 if (t // 7) % 2 else 30) for t in range(0, 600)]
    fleet.run(trace, until=600)
    changes = fleet.direction_changes()
    for a, b in zip(changes, changes[1:]):
        assert b - a >= min(policy.scale_up_window, policy.scale_down_window), changes
    assert len(changes) <= 600 / policy.scale_up_window


def test_a_noisy_steady_load_never_flips_within_a_window():
    import random

    rng = random.Random(7)
    policy = Policy(min_replicas=1, max_replicas=10, target_in_flight=16, scale_up_window=5, scale_down_window=60)
    fleet = Fleet(policy, replicas=3, load_seconds=30)
    trace = [(float(t), max(0, int(rng.gauss(40, 6)))) for t in range(900)]
    fleet.run(trace, until=900)
    changes = fleet.direction_changes()
    for a, b in zip(changes, changes[1:]):
        assert b - a >= policy.scale_up_window, changes
    # a scale-down follows a scale-up no sooner than the scale-down window
    events = [(t, d) for (t, _l, d, _r), (_t0, _l0, d0, _r0) in zip(fleet.log[1:], fleet.log) if d != d0]
    for (t1, d1), (t2, d2), (t0, d0) in zip(events[1:], events[2:], events):
        if d1 > d0 and d2 < d1:
            assert t2 - t1 >= policy.scale_down_window, events
    assert {d for _t, d in events} <= {3, 4, 5}


def test_a_wavering_load_does_not_start_and_kill_replicas_when_a_model_load_outlasts_the_down_window():
    # What CI's end-to-end run saw: 5 closed-loop clients on one replica read as 4 in flight, then 1 for a few
    # seconds, and so on, while the second replica took ~10 s to load with a 3 s scale-down window: it was
    # removed before it was ready, re-added a second later, removed again, and never served.
    policy = Policy(min_replicas=0, max_replicas=2, target_in_flight=2, scale_up_window=1, scale_down_window=3,
                    scale_to_zero_after=5)
    fleet = Fleet(policy, replicas=1, load_seconds=10)
    trace = [(float(t), 4 if t % 6 < 2 else 1) for t in range(120)]
    desired = fleet.run(trace, until=120)
    assert fleet.removed_while_starting == 0, fleet.log
    ups = [t for t, _l, _d, r in fleet.log if r == "ScaleUp"]
    # each scale-up's replica becomes ready and serves a whole down window before it may go
    for a, b in zip(ups, ups[1:]):
        assert b - a >= fleet.load_seconds + policy.scale_down_window, fleet.log
    assert 2 in desired
    # a replica that never becomes ready (crash-looping) holds scale-downs only up to its startup timeout
    policy = Policy(min_replicas=1, max_replicas=2, target_in_flight=2, scale_up_window=1, scale_down_window=3,
                    startup_timeout=30)
    fleet = Fleet(policy, replicas=1, load_seconds=10_000)
    desired = fleet.run([(0.0, 4), (5.0, 1)], until=60)
    down = next(t for t, _l, d, _r in fleet.log if t > 5 and d == 1)
    assert 1 + 30 <= down <= 1 + 30 + policy.scale_down_window + 1, fleet.log
    starting = next(r for t, _l, _d, r in fleet.log if t == 10)
    assert starting == "WaitingForStartingReplicas", fleet.log


def test_a_new_leader_watches_a_whole_down_window_before_scaling_down_and_counts_idle_time_from_its_start():
    # An operator restart (or a leader change) starts with no history: one idle scrape of a busy fleet (a gap
    # between requests) must not remove replicas, nor count as idle since forever.
    policy = Policy(min_replicas=0, max_replicas=5, scale_down_window=60, scale_to_zero_after=300)
    history = History()
    for t in range(0, 60):
        d = decide(Observation(now=1000.0 + t, current=3, ready=3), policy, history)
        assert d.desired == 3 and d.reason == "Stabilizing", d
    assert "just started" in d.message
    d = decide(Observation(now=1060.0, current=3, ready=3), policy, history)
    assert d.desired == 1 and d.reason == "ScaleDown", d
    ds = [decide(Observation(now=1060.0 + t, current=1, ready=1), policy, history) for t in range(1, 241)]
    assert {d.desired for d in ds[:-1]} == {1} and ds[-1].desired == 0, ds[-1]  # zero at 300 s after start
    # bounds still apply at once
    d = decide(Observation(now=0.0, current=7, ready=7), policy, History())
    assert d.desired == 5


def test_victims_are_the_least_busy_and_not_ready_first():
    replicas = [ReplicaLoad("busy", running=9), ReplicaLoad("idle", running=0), ReplicaLoad("some", running=2),
                ReplicaLoad("loading", ready=False)]
    assert pick_victims(replicas, 2) == ["loading", "idle"]
    assert pick_victims(replicas, 0) == []


@pytest.mark.parametrize("kwargs", [dict(min_replicas=3, max_replicas=2), dict(max_replicas=0),
                                    dict(target_in_flight=0), dict(target_kv_cache_usage=1.5)])
def test_bad_policy_is_refused_with_a_message(kwargs):
    with pytest.raises(ValueError, match="must|need"):
        Policy(**kwargs)


def test_spec_autoscaling_defaults_and_errors():
    from shoal.operator import api

    spec = api.parse_spec({"autoscaling": {"minReplicas": 0, "maxReplicas": 4}})
    a = spec.autoscaling
    assert (a.target_in_flight_per_replica, a.target_kv_cache_usage, a.scale_up_stabilization_seconds,
            a.scale_down_stabilization_seconds, a.scale_to_zero_after_seconds) == (16, 0.8, 5, 60, 300)
    assert api.parse_spec({}).autoscaling is None
    with pytest.raises(api.SpecError) as e:
        api.parse_spec({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}})
    assert e.value.field == "spec.autoscaling.minReplicas"
    with pytest.raises(api.SpecError) as e:
        api.parse_spec({"autoscaling": {"minReplicas": 1}})
    assert e.value.field == "spec.autoscaling.maxReplicas"


def test_an_unanswered_metrics_scrape_is_unknown_load_not_idleness():
    """A busy engine can miss the scrape timeout: reading it as 0 in flight would scale a serving replica away
    (down, or to zero once scaleToZeroAfter had passed on such reads)."""
    policy = Policy(min_replicas=0, max_replicas=4, target_in_flight=2, scale_up_window=1, scale_down_window=3,
                    scale_to_zero_after=5)
    history = History()
    current = decide(Observation(now=0.0, current=2, ready=2, replicas=(ReplicaLoad("a", running=2),
                                                                        ReplicaLoad("b", running=2))),
                     policy, history).desired
    # From t=1 every scrape times out, for far longer than both windows; at t=30 one engine answers (idle).
    for t in range(1, 31):
        loads = (ReplicaLoad("a"),) if t == 30 else ()
        d = decide(Observation(now=float(t), current=current, ready=2, replicas=loads, unanswered=1 if t == 30 else 2),
                   policy, history)
        assert d.desired == 2 and d.reason == "LoadUnknown" and "did not answer" in d.message, (t, d)
        current = d.desired
    # Both answer, idle: the windows count from the last unknown tick (t=30), not from the last load (t=0).
    desired = {}
    for t in range(31, 40):
        current = desired[t] = decide(Observation(now=float(t), current=current, ready=current,
                                                  replicas=(ReplicaLoad("a"), ReplicaLoad("b"))[:current]),
                                      policy, history).desired
    assert desired[33] == 2 and desired[34] == 1  # the 3 s scale-down window after t=30
    assert desired[35] == 0  # and zero 5 s after t=30


def test_the_autoscaler_validates_with_the_operators_gpus_per_node():
    """With --max-gpus-per-node 16 a 16-GPU pod is valid: the autoscaler must not refuse the spec (as it did,
    validating with 8 whatever the flag said, and logging that at debug)."""
    from shoal.operator import api
    from shoal.operator.autoscaler import Autoscaler

    isvc = {"metadata": {"name": "big", "namespace": "ns"},
            "spec": {"engine": {"tensorParallelSize": 16}, "autoscaling": {"minReplicas": 1, "maxReplicas": 2}}}
    spec = Autoscaler(kube=None, max_gpus_per_node=16).spec_of(isvc)
    assert spec.gpus_per_pod(16) == 16 and spec.pods_per_replica(16) == 1
    with pytest.raises(api.SpecError):
        Autoscaler(kube=None, max_gpus_per_node=8).spec_of(isvc)


# ------------------------------------------------------------------------------- scaleToZero sleep (park/wake)
def test_idle_fleet_is_parked_asleep_not_deleted_and_woken_by_the_next_request():
    """The decision counts awake replicas; park() turns it into engines to sleep or wake and keeps the pods."""
    policy = Policy(min_replicas=0, max_replicas=4, scale_down_window=60, scale_to_zero_after=120)
    history = History()
    one = (ReplicaLoad("p0"),)
    for t in range(0, 120):
        d = decide(Observation(now=float(t), current=1, ready=1, replicas=one), policy, history)
        assert d.desired == 1
    d = decide(Observation(now=120.0, current=1, ready=1, replicas=one), policy, history)
    assert (d.desired, d.reason) == (0, "ScaleToZero")
    obs = Observation(now=120.0, current=1, ready=1, replicas=one)
    assert park(obs, d.desired) == Parking(sleep=("p0",), pods=1)  # parked, the pod stays
    # asleep: not Ready, not awake; idle stays parked
    asleep = Observation(now=121.0, current=0, ready=0, replicas=(ReplicaLoad("p0", ready=False),), asleep=("p0",))
    d = decide(asleep, policy, history)
    assert d.desired == 0 and park(asleep, d.desired) == Parking(pods=1)
    # a held request: the operator wakes the parked engine instead of starting a pod
    held = Observation(now=130.0, current=0, ready=0, replicas=(ReplicaLoad("p0", ready=False),), asleep=("p0",),
                       held=1, wake=True)
    d = decide(held, policy, history)
    assert (d.desired, d.reason) == (1, "ScaleFromZero")
    assert park(held, d.desired) == Parking(wake=("p0",), pods=1)


def test_parking_wakes_parked_replicas_before_adding_pods_and_removes_awake_ones_first():
    replicas = (ReplicaLoad("a", running=3), ReplicaLoad("s1", ready=False), ReplicaLoad("s2", ready=False))
    obs = Observation(now=0.0, current=1, ready=1, replicas=replicas, asleep=("s2", "s1"))
    assert obs.pods == 3
    assert park(obs, 2) == Parking(wake=("s1",), pods=3)
    assert park(obs, 5) == Parking(wake=("s1", "s2"), pods=5)  # both parked woken, two pods added
    assert park(obs, 1) == Parking(pods=3)  # steady
    # scale-down short of zero deletes awake pods; the parked ones are the last victims
    two_awake = Observation(now=0.0, current=2, ready=2, replicas=(ReplicaLoad("a"), ReplicaLoad("b"),
                                                                    ReplicaLoad("s", ready=False)), asleep=("s",))
    assert park(two_awake, 1) == Parking(pods=2)
    assert pick_victims(list(two_awake.replicas), 1, keep=("s",)) == ["a"]


def test_busy_or_starting_replicas_are_not_put_to_sleep():
    replicas = (ReplicaLoad("busy", running=1), ReplicaLoad("loading", ready=False), ReplicaLoad("idle"))
    obs = Observation(now=0.0, current=3, ready=2, replicas=replicas)
    assert park(obs, 0) == Parking(sleep=("idle",), pods=3)
def test_pending_batch_work_wakes_from_zero_and_keeps_one_replica_but_sizes_nothing():
    policy = Policy(min_replicas=0, max_replicas=8, target_in_flight=4, scale_down_window=5, scale_to_zero_after=10)
    history = History()
    # a batch of 1000 requests against a fleet at zero: one replica, at once (not 250)
    d = decide(Observation(now=0.0, current=0, ready=0, batch_pending=1000), policy, history)
    assert (d.desired, d.reason) == (1, "ScaleFromZero")
    assert "1000 batch requests pending" in d.message
    # the batch runs for a long time with no interactive load: never scaled to zero meanwhile
    for t in range(1, 120):
        d = decide(Observation(now=float(t), current=1, ready=1, batch_pending=1000 - t), policy, history)
        assert d.desired == 1, d
    # the batch is done: zero after scaleToZeroAfter of idleness, counted from its last pending request
    ds = {t: decide(Observation(now=float(t), current=1, ready=1), policy, history).desired for t in range(120, 135)}
    assert ds[128] == 1 and ds[134] == 0
    # interactive load on top sizes the fleet as usual; the batch adds nothing to it
    d = decide(Observation(now=0.0, current=1, ready=1, replicas=(ReplicaLoad("p", running=12),), batch_pending=500),
               Policy(min_replicas=0, target_in_flight=4, scale_up_window=0), History())
    assert d.desired == 3


# ---- the prefill role (spec.prefill.autoscaling): the same rules on its own signal -------------------------------
def prefill_policy(**kw) -> Policy:
    """As autoscaler.prefill_policy_of renders spec.prefill.autoscaling: no KV-cache signal."""
    return Policy(**{"min_replicas": 0, "max_replicas": 6, "target_kv_cache_usage": None,
                     "target_waiting_prefill_tokens": 8192, "scale_up_window": 0, "scale_down_window": 10,
                     "scale_to_zero_after": 30, **kw})


def test_prefill_role_is_sized_by_its_waiting_prefill_tokens_and_not_by_kv():
    # 3 prefill engines, 50000 prompt tokens waiting, few requests, caches full of KV waiting for the pulls
    loads = tuple(ReplicaLoad(f"pf{i}", running=1, waiting_prefill_tokens=t, kv_cache_usage=0.95)
                  for i, t in enumerate((20000, 20000, 10000)))
    d = decide(Observation(now=0.0, current=3, ready=3, replicas=loads), prefill_policy(), History())
    assert (d.desired, d.needed, d.reason) == (6, 7, "ScaleUp")  # ceil(50000/8192) = 7, capped at maxReplicas 6
    assert "waiting prefill" in d.message and "KV" not in d.message and "(maxReplicas)" in d.message
    # many short prompts: in-flight decides
    loads = (ReplicaLoad("pf0", running=8, waiting=30, waiting_prefill_tokens=3000),)
    d = decide(Observation(now=0.0, current=1, ready=1, replicas=loads), prefill_policy(), History())
    assert (d.desired, d.needed) == (3, 3)  # ceil(38/16)


def test_prefill_role_scales_from_zero_on_the_tokens_the_decode_engines_prefill_themselves():
    policy, history = prefill_policy(), History()
    idle = decide(Observation(now=0.0, current=0, ready=0), policy, history)
    assert (idle.desired, idle.reason) == (0, "Steady")
    # no prefill engine: the decode engines prefill 20000 prompt tokens themselves -> at once, no window
    d = decide(Observation(now=1.0, current=0, ready=0, fallback_prefill_tokens=20000), policy, history)
    assert (d.desired, d.reason) == (3, "ScaleFromZero") and "on the decode engines" in d.message
    # while they start, the same load counts once (capacity arriving), not more
    d = decide(Observation(now=2.0, current=3, ready=0, fallback_prefill_tokens=20000), policy, history)
    assert d.desired == 3


def test_prefill_role_goes_to_zero_only_after_scale_to_zero_after_without_prefill():
    policy, history = prefill_policy(scale_to_zero_after=30, scale_down_window=10), History()
    busy = (ReplicaLoad("pf0", running=2, waiting_prefill_tokens=9000), ReplicaLoad("pf1", running=2))
    assert decide(Observation(now=0.0, current=2, ready=2, replicas=busy), policy, history).desired == 2
    out = {}
    for t in range(1, 40):
        idle = (ReplicaLoad("pf0"), ReplicaLoad("pf1"))
        d = decide(Observation(now=float(t), current=out.get("current", 2), ready=out.get("current", 2),
                               replicas=idle[:out.get("current", 2)]), policy, history)
        out["current"] = d.desired
        out.setdefault(d.desired, t)
    assert out[1] == 11  # the load seen at t=0 leaves the 10 s down window; then the floor short of zero: one
    assert out[0] == 30 and out["current"] == 0  # idle for scaleToZeroAfterSeconds since the last load (t=0)


def test_a_policy_without_kv_signal_rejects_nothing_and_a_bad_kv_target_still_fails():
    Policy(target_kv_cache_usage=None)
    with pytest.raises(ValueError, match="targetKVCacheUsage"):
        Policy(target_kv_cache_usage=1.5)
