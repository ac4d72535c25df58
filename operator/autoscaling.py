"""The autoscaling decision: load samples + replica counts + policy + history -> desired replicas and a reason.

Pure and synchronous (no I/O, the clock is an argument), so it is tested on recorded load traces.

How the number is chosen
------------------------
Every signal is turned into an *absolute* number of replicas the load needs, never into a ratio of the replicas
that happen to be ready::

    by in-flight   = ceil((running + waiting on every engine + requests held by the gateway) / targetInFlight)
    by KV cache    = ceil(sum of KV-cache usage over serving engines / targetKVCacheUsage)
    by prefill     = ceil(prompt tokens waiting for prefill / targetWaitingPrefillTokens)      (when set)

The prefill role (spec.prefill.autoscaling) is decided by the same rules on its own observation and history: its
engines' in-flight requests and waiting prefill tokens (no KV signal: a prefill engine's cache holds KV only
until the decode engine pulls it), plus, while none of its engines is ready, the prompt tokens the decode engines
wait to prefill themselves (``fallback_prefill_tokens``): that load scales the role from zero.

and the recommendation is the largest of them. A replica that is still starting (pod created, model loading)
counts as capacity that is arriving: the load it will absorb is already in the sums above, so a slow model load
does not make the recommendation climb (the ratio formula of a CPU-style HPA does climb, because only ready
pods report and they stay saturated until the new ones arrive; that is why 300 s windows are usual there).

Stabilization, per direction (like the HPA's behavior field):
* scale up to the *lowest* recommendation of the last ``scaleUpStabilizationSeconds`` (a spike shorter than the
  window does not add replicas);
* scale down to the *highest* recommendation of the last ``scaleDownStabilizationSeconds``;
* a change of direction waits for the window of the new direction since the last change, so steady load
  flips direction at most once per window;
* a scale-down after a scale-up waits, in addition, until the replicas it added have started (or their startup
  timeout has passed), and then a whole down window: load seen while capacity is still arriving says little
  about what the grown fleet will carry, and a replica removed while it loads its model was paid for and never
  served (with a down window shorter than a model load, a wavering load would start and kill replicas forever);
* nothing scales down before the autoscaler has watched the load for a whole down window, and idle time counts
  from its first observation: an operator restart or a new leader starts with no history, and one idle scrape
  is not an idle fleet;
* the last replica goes only after ``scaleToZeroAfterSeconds`` without any load (and only with minReplicas 0),
  and never while it is still starting (it was started for someone, typically a request the gateway holds);
* from zero, any load (a held request, a wake-up from the gateway) scales to the need at once, bypassing the
  windows: someone is waiting;
* batch work the gateway has not finished (shoal:gateway_batch_pending_requests) keeps at least one replica — it
  wakes a fleet at zero and keeps the fleet from scaling to zero — but sizes nothing beyond that: batch requests
  run in capacity interactive traffic leaves free, so a batch of thousands of requests does not buy replicas;
* a Ready engine or gateway whose /metrics did not answer (a busy engine can be slow to) is load unknown, not zero:
  such a tick counts as busy and never scales down, so a replica is not removed while it may be serving.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

# Defaults, documented in api.Autoscaling and docs/autoscaling.md.
DEFAULT_TARGET_IN_FLIGHT = 16
DEFAULT_TARGET_KV_CACHE_USAGE = 0.8


@dataclass(frozen=True)
class ReplicaLoad:
    """One engine replica's load, scraped from its /metrics (shoal:num_requests_running/waiting, ...)."""

    pod: str
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    waiting_prefill_tokens: int = 0
    ready: bool = True  # False: starting or draining; it still carries in-flight requests

    @property
    def in_flight(self) -> int:
        return self.running + self.waiting


@dataclass(frozen=True)
class Observation:
    """Everything one decision looks at, taken at time `now` (seconds, monotonic)."""

    now: float
    current: int  # spec.replicas as it is
    ready: int  # replicas serving
    replicas: tuple[ReplicaLoad, ...] = ()
    held: int = 0  # requests the gateway holds because no replica is ready
    wake: bool = False  # the gateway asked for capacity since the last decision
    unanswered: int = 0  # Ready engines/gateways whose /metrics did not answer: their load is unknown, not zero
    # scaleToZero sleep: pods whose engine is asleep (kept, not counted in `current`, which is the awake replicas)
    asleep: tuple[str, ...] = ()
    batch_pending: int = 0  # batch requests the gateways have not finished: busy, but no more than one replica
    # The prefill role (spec.prefill.autoscaling): prompt tokens the decode engines wait to prefill themselves
    # while no prefill engine is ready. Load the role would carry: it scales the role up (from zero too).
    fallback_prefill_tokens: int = 0

    @property
    def pods(self) -> int:  # the replica count the workload runs: awake and asleep
        return self.current + len(self.asleep)

    @property
    def starting(self) -> int:
        return max(self.current - self.ready, 0)

    @property
    def in_flight(self) -> int:
        return sum(r.in_flight for r in self.replicas) + self.held

    @property
    def kv_sum(self) -> float:
        return sum(r.kv_cache_usage for r in self.replicas if r.ready)

    @property
    def waiting_prefill_tokens(self) -> int:
        return sum(r.waiting_prefill_tokens for r in self.replicas) + self.fallback_prefill_tokens


@dataclass(frozen=True)
class Policy:
    min_replicas: int = 1
    max_replicas: int = 10
    target_in_flight: int = DEFAULT_TARGET_IN_FLIGHT
    target_kv_cache_usage: float | None = DEFAULT_TARGET_KV_CACHE_USAGE  # None: not a signal (the prefill role)
    target_waiting_prefill_tokens: int | None = None
    scale_up_window: float = 5.0
    scale_down_window: float = 60.0
    scale_to_zero_after: float = 300.0
    startup_timeout: float = 1800.0  # how long a replica may take to start (the startup probe's budget)

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"need 0 <= minReplicas ({self.min_replicas}) <= maxReplicas ({self.max_replicas}), "
                             "maxReplicas >= 1")
        kv = self.target_kv_cache_usage
        if self.target_in_flight < 1 or (kv is not None and not 0 < kv <= 1):
            raise ValueError("targetInFlight must be >= 1 and targetKVCacheUsage in (0, 1]")


@dataclass(frozen=True)
class Decision:
    desired: int
    reason: str  # CamelCase, for the condition and the Event
    message: str  # what a person reads: the inputs and why
    needed: int  # what the load needs right now, before stabilization and limits

    def direction(self, current: int) -> int:
        return (self.desired > current) - (self.desired < current)


@dataclass
class History:
    """What the decision remembers between calls (kept in the operator's memory, per InferenceService)."""

    recommendations: deque = field(default_factory=deque)  # (time, needed)
    last_change_time: float | None = None
    last_direction: int = 0
    last_busy: float | None = None  # last time any load was seen
    last_desired: int = 0  # the count of the last change
    arrived_at: float | None = None  # when the replicas of the last scale-up had all started (None: not yet)
    started_at: float | None = None  # the first observation (a new operator leader starts with no history)

    def since_change(self, now: float) -> float:
        return math.inf if self.last_change_time is None else now - self.last_change_time

    def forget_before(self, t: float) -> None:
        while self.recommendations and self.recommendations[0][0] < t:
            self.recommendations.popleft()


def needed_replicas(obs: Observation, policy: Policy) -> tuple[int, str]:
    """What the load needs, and which signal says so."""
    by = {"in-flight": math.ceil(obs.in_flight / policy.target_in_flight)}
    if policy.target_kv_cache_usage is not None:
        by["KV cache"] = math.ceil(round(obs.kv_sum / policy.target_kv_cache_usage, 6))
    if policy.target_waiting_prefill_tokens:
        by["waiting prefill"] = math.ceil(obs.waiting_prefill_tokens / policy.target_waiting_prefill_tokens)
    signal = max(by, key=lambda k: by[k])
    return by[signal], signal


def _inputs(obs: Observation, policy: Policy) -> str:
    text = f"{obs.in_flight} in flight ({obs.held} held) for target {policy.target_in_flight}/replica"
    if policy.target_kv_cache_usage is not None:
        text += f", KV {obs.kv_sum:.2f} for target {policy.target_kv_cache_usage:.2f}/replica"
    if policy.target_waiting_prefill_tokens:
        text += (f", {obs.waiting_prefill_tokens} prefill tokens waiting for target "
                 f"{policy.target_waiting_prefill_tokens}/replica")
        if obs.fallback_prefill_tokens:
            text += f" ({obs.fallback_prefill_tokens} on the decode engines, no prefill engine ready)"
    if obs.batch_pending:
        text += f", {obs.batch_pending} batch requests pending"
    return text + f"; {obs.ready} ready, {obs.starting} starting"


@dataclass(frozen=True)
class Tick:
    """What the rules read at one decision: the observation, the policy, the history so far and the derived
    numbers (rules never change any of it)."""

    obs: Observation
    policy: Policy
    history: History
    needed: int  # what the load needs now
    signal: str  # which signal says so
    busy: bool  # any load or a wake-up
    up_to: int  # lowest recommendation of the scale-up window
    down_to: int  # highest recommendation of the scale-down window

    @property
    def now(self) -> float:
        return self.obs.now

    @property
    def current(self) -> int:
        return self.obs.current

    @property
    def floor(self) -> int:  # fewest replicas short of zero
        return max(self.policy.min_replicas, 1)

    @property
    def wants_fewer(self) -> bool:
        return self.down_to < self.current

    @property
    def wants_zero(self) -> bool:
        return self.wants_fewer and self.down_to == 0 and self.policy.min_replicas == 0

    @property
    def scaled_up_last(self) -> bool:
        return self.history.last_direction > 0

    @property
    def idle_for(self) -> float:
        h = self.history
        return self.now - (h.last_busy if h.last_busy is not None else h.started_at)


Verdict = tuple[int, str, str]  # (desired before limits, reason, why)


# The rules, in the order they are asked: the first that answers decides. Each is a pure function of the tick.
def scale_from_zero(t: Tick) -> Verdict | None:
    if t.current == 0 and t.busy:  # someone is waiting: no window applies
        return t.needed, "ScaleFromZero", f"scale from zero to {min(t.needed, t.policy.max_replicas)}"
    return None


def scale_up(t: Tick) -> Verdict | None:
    p = t.policy
    if min(t.up_to, p.max_replicas) <= t.current:
        return None
    if t.history.last_direction < 0 and t.history.since_change(t.now) < p.scale_up_window:
        return t.current, "Stabilizing", f"{t.up_to} needed, but scaled down less than {p.scale_up_window:g}s ago"
    capped = " (maxReplicas)" if t.up_to > p.max_replicas else ""
    return t.up_to, "ScaleUp", f"scale up to {min(t.up_to, p.max_replicas)}{capped} by {t.signal}"


def load_unknown(t: Tick) -> Verdict | None:
    if t.obs.unanswered and t.needed < t.current:
        return t.current, "LoadUnknown", (f"{t.needed} needed by the load seen, but {t.obs.unanswered} /metrics "
                                          "did not answer; not scaling down on partial load")
    return None


def just_started_watching(t: Tick) -> Verdict | None:
    # One idle scrape after an operator restart or a leader change is not an idle fleet.
    watched = t.now - t.history.started_at
    if not t.wants_fewer or watched >= t.policy.scale_down_window:
        return None
    if t.current > t.policy.max_replicas:
        return t.current, "OutOfBounds", "replicas brought within [minReplicas, maxReplicas]"
    return t.current, "Stabilizing", (f"{t.down_to} needed, but the load has been watched for only {watched:.0f}s "
                                      f"of the {t.policy.scale_down_window:g}s scale-down window (the autoscaler "
                                      "just started)")


def scale_up_still_arriving(t: Tick) -> Verdict | None:
    if t.wants_fewer and t.scaled_up_last and t.history.arrived_at is None:
        return t.current, "WaitingForStartingReplicas", (f"{t.down_to} needed, but the replicas of the last "
                                                         "scale-up are still starting")
    return None


def scale_up_just_arrived(t: Tick) -> Verdict | None:
    window = t.policy.scale_down_window
    arrived = t.history.arrived_at
    if t.wants_fewer and t.scaled_up_last and arrived is not None and t.now - arrived < window:
        return t.current, "Stabilizing", (f"{t.down_to} needed, but the last scale-up completed less than "
                                          f"{window:g}s ago")
    return None


def last_replica_starting(t: Tick) -> Verdict | None:
    # a replica still loading was asked for (by a held request, most likely): let it serve first
    if t.wants_zero and t.obs.starting and t.current <= t.floor:
        return t.current, "WaitingForStartingReplicas", (f"no load seen, but {t.obs.starting} replica(s) still "
                                                         "starting; not scaling to zero")
    return None


def scale_to_zero(t: Tick) -> Verdict | None:
    if t.wants_zero and t.idle_for >= t.policy.scale_to_zero_after:
        return 0, "ScaleToZero", f"idle for {t.policy.scale_to_zero_after:g}s"
    return None


def scale_down_towards_zero(t: Tick) -> Verdict | None:
    if t.wants_zero and t.current > t.floor:
        return t.floor, "ScaleDown", f"scale down to {t.floor}; zero after {t.policy.scale_to_zero_after:g}s idle"
    return None


def waiting_to_scale_to_zero(t: Tick) -> Verdict | None:
    after = t.policy.scale_to_zero_after
    if t.wants_zero:
        return t.current, "WaitingToScaleToZero", (f"idle for {min(t.idle_for, after):.0f}s of {after:g}s before "
                                                   "scaling to zero")
    return None


def scale_down(t: Tick) -> Verdict | None:
    target = max(t.down_to, t.floor)
    if t.wants_fewer and target < t.current:
        return target, "ScaleDown", f"scale down to {target}"
    return None


def out_of_bounds(t: Tick) -> Verdict | None:
    if not t.policy.min_replicas <= t.current <= t.policy.max_replicas:
        return t.current, "OutOfBounds", "replicas brought within [minReplicas, maxReplicas]"
    return None


def limited_by_max_replicas(t: Tick) -> Verdict | None:
    if t.needed > t.current >= t.policy.max_replicas:
        return t.current, "LimitedByMaxReplicas", f"{t.needed} needed, maxReplicas is {t.policy.max_replicas}"
    return None


def steady(t: Tick) -> Verdict:
    return t.current, "Steady", f"{t.current} replicas fit the load"


RULES: tuple[Callable[[Tick], Verdict | None], ...] = (
    scale_from_zero, scale_up, load_unknown,
    just_started_watching, scale_up_still_arriving, scale_up_just_arrived,
    last_replica_starting, scale_to_zero, scale_down_towards_zero, waiting_to_scale_to_zero,
    scale_down, out_of_bounds, limited_by_max_replicas, steady,
)


def _observe(obs: Observation, policy: Policy, history: History) -> Tick:
    """Record the observation in `history` (load seen, the recommendation, arrival of a scale-up) -> the tick."""
    now, current = obs.now, obs.current
    if history.started_at is None:
        history.started_at = now
    needed, signal = needed_replicas(obs, policy)
    busy = obs.in_flight > 0 or obs.wake or obs.batch_pending > 0 or obs.fallback_prefill_tokens > 0
    if busy or obs.unanswered:  # an unanswered scrape may hide load: never evidence of idleness
        history.last_busy = now
    if busy:
        needed = max(needed, 1)
    # Unknown load recommends what is there: the down window restarts once every scrape answers again.
    history.recommendations.append((now, max(needed, current) if obs.unanswered else needed))
    history.forget_before(now - max(policy.scale_up_window, policy.scale_down_window))
    if history.last_direction > 0 and history.arrived_at is None and (
            (current >= history.last_desired and obs.starting == 0)  # (current: the scale may not show yet)
            or history.since_change(now) >= policy.startup_timeout):
        history.arrived_at = now
    up_to = min(n for t, n in history.recommendations if t >= now - policy.scale_up_window)
    down_to = max(n for t, n in history.recommendations if t >= now - policy.scale_down_window)
    return Tick(obs, policy, history, needed, signal, busy, up_to, down_to)


def _remember_change(history: History, now: float, current: int, desired: int) -> None:
    direction = (desired > current) - (desired < current)
    if direction:
        history.last_change_time, history.last_direction, history.last_desired = now, direction, desired
        history.arrived_at = None


def decide(obs: Observation, policy: Policy, history: History) -> Decision:
    """The desired replica count for `obs`; updates `history` (call once per observation, in time order)."""
    tick = _observe(obs, policy, history)
    desired, reason, why = next(v for rule in RULES if (v := rule(tick)) is not None)
    desired = min(max(desired, policy.min_replicas), policy.max_replicas)
    _remember_change(history, obs.now, obs.current, desired)
    return Decision(desired, reason, f"{why}: {_inputs(obs, policy)}", tick.needed)


@dataclass(frozen=True)
class Parking:
    """What scaleToZero sleep does with a decision of `desired` awake replicas: engines to put to sleep, engines to
    wake up, and the pod count to run (awake + asleep)."""

    sleep: tuple[str, ...] = ()
    wake: tuple[str, ...] = ()
    pods: int = 0


def park(obs: Observation, desired: int) -> Parking:
    """Scale to zero parks every awake replica asleep (pods kept); more replicas wake parked ones before pods are
    added; fewer replicas, short of zero, remove awake pods (the parked stay parked: they are the fast way back).

    A replica with requests in flight is never put to sleep (the engine refuses anyway: its KV cache would go), nor
    one still starting (it has no model to free yet): both are asked again on a later decision."""
    awake = obs.current
    if desired == 0 and awake:
        idle = tuple(sorted(r.pod for r in obs.replicas
                            if r.ready and r.in_flight == 0 and r.pod not in obs.asleep))
        return Parking(sleep=idle, pods=obs.pods)
    if desired > awake:
        woken = tuple(sorted(obs.asleep)[:desired - awake])
        return Parking(wake=woken, pods=obs.pods + (desired - awake - len(woken)))
    return Parking(pods=obs.pods - (awake - desired))


def pick_victims(replicas: list[ReplicaLoad], count: int, keep: tuple[str, ...] = ()) -> list[str]:
    """The `count` pods to remove on scale-down: the ones with the least in flight (not-ready ones first); the
    pods in `keep` (parked asleep) last."""
    order = sorted(replicas, key=lambda r: (r.pod in keep, r.ready, r.in_flight, r.kv_cache_usage, r.pod))
    return [r.pod for r in order[:max(count, 0)]]
