"""EngineConfig: every knob of the engine in one validated place (the CLI and LLM() both build one).

DistributedConfig is the part a multi-process group needs before any model is known: how a rank finds its group
and notices failures. It travels inside EngineConfig (`config.distributed`), on its own to a --headless node and
to every worker process (as JSON on its command line).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shoal.engine.flags import Flag, parse_bytes, parse_dtype, parse_int_list, parse_len

# a DNS name: labels of letters, digits and hyphens, joined by dots
_HOSTNAME = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*$")
DEFAULT_CPU_KV_CACHE_BYTES = 512 * 1024 * 1024  # 512 MiB on CPU unless --kv-cache-memory says otherwise

# Value sets shared with the operator's spec.engine (shoal.operator.api): one definition each.
Dtype = Literal["auto", "float32", "float16", "bfloat16"]
AttentionBackend = Literal["auto", "sdpa", "triton", "flash", "cpu"]
PoolingType = Literal["LAST", "MEAN", "CLS"]
Runner = Literal["auto", "generate", "pooling"]

MODEL, ENGINE, MULTI_NODE = "model", "engine", "multi-node (torch.distributed)"  # --help sections
LORA = "LoRA adapters"
MEDIA = "images (vision-language models)"


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


class DistributedConfig(BaseModel):
    """How this process joins its tensor/pipeline-parallel group (flags: --nnodes, --node-rank, --master-addr,
    --master-port, --distributed-*, --heartbeat-timeout, --pipeline-*). The defaults suit one machine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nnodes: Annotated[int, Flag(MULTI_NODE, "number of nodes (pods) in this engine's group")] = Field(
        default=1, gt=0)
    node_rank: Annotated[int, Flag(MULTI_NODE, "this node's index; node 0 runs rank 0 and the API server")] = Field(
        default=0, ge=0)
    master_addr: Annotated[str, Flag(MULTI_NODE, "address of node 0 (rank 0 hosts the rendezvous)")] = "127.0.0.1"
    master_port: Annotated[int | None, Flag(
        MULTI_NODE, "rendezvous port on node 0 (default: a free port on one node, 29500 on several)")] = Field(
        default=None, gt=0, lt=65536)
    backend: Annotated[Literal["nccl", "gloo"] | None, Flag(
        MULTI_NODE, "torch.distributed backend (default: nccl on CUDA, gloo on CPU)",
        name="--distributed-backend")] = None
    startup_timeout: Annotated[float, Flag(
        MULTI_NODE, "seconds ranks wait for each other at start-up, logging who is missing",
        name="--distributed-startup-timeout")] = Field(default=600.0, gt=0)
    collective_timeout: Annotated[float, Flag(
        MULTI_NODE, "seconds a collective or send/recv may wait before the group is declared failed",
        name="--distributed-timeout")] = Field(default=20.0, gt=0)
    heartbeat_interval: float = Field(default=1.0, gt=0)
    heartbeat_timeout: Annotated[float, Flag(
        MULTI_NODE, "seconds without a rank's heartbeat before the group is declared failed")] = Field(
        default=10.0, gt=0)
    exit_on_failure: bool = Field(default=False, description="rank 0 exits 1 after exit_grace once a rank failed "
                                                             "(serving); the offline LLM raises instead")
    exit_grace: float = Field(default=2.0, ge=0)
    micro_batches: Annotated[int | None, Flag(
        MULTI_NODE, "micro-batches per step in flight through the pipeline (default: one per stage)",
        name="--pipeline-micro-batches")] = Field(default=None, gt=0)
    layer_partition: Annotated[list[int] | None, Flag(
        MULTI_NODE, "decoder layers per pipeline stage, e.g. 5,3 (default: an even split; the last stage also runs "
                    "the LM head, so giving it fewer layers can balance the stages)",
        name="--pipeline-layer-partition", type=parse_int_list, metavar="N,N,...")] = None

    @model_validator(mode="after")
    def _check(self) -> "DistributedConfig":
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be in [0, nnodes {self.nnodes})")
        if self.layer_partition is not None and min(self.layer_partition, default=0) < 1:
            raise ValueError(f"layer_partition {self.layer_partition} must list positive layer counts")
        return self


class SpeculativeConfig(BaseModel):
    """Speculative decoding (vLLM's --speculative-config JSON): cheap proposals of the next few tokens, verified
    by the target model in one forward pass (engine/core/speculative.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "draft_model", "mtp"] = Field(
        description="ngram: prompt lookup, the tokens that followed the latest earlier occurrence of the sequence's "
                    "last n tokens; draft_model: a smaller model with the same tokenizer proposes them (implied by "
                    "`model`); mtp (alias deepseek_mtp): the multi-token-prediction layer a DeepSeek V3, Qwen3-Next or "
                    "Qwen3.5 checkpoint ships proposes them from the target's hidden states")
    model: str | None = Field(default=None, description="the draft model (draft_model): a local Hugging Face "
                                                        "directory, a hub id in the local cache, or a .gguf file")
    num_speculative_tokens: int = Field(gt=0, le=64, description="tokens proposed per step")
    prompt_lookup_max: int = Field(default=4, gt=0, description="longest n-gram matched (ngram)")
    prompt_lookup_min: int = Field(default=1, gt=0, description="shortest n-gram matched (ngram)")
    # Off for a step when more sequences than this are running: verifying K+1 positions per sequence then costs
    # more than the accepted tokens save. Measured on the 2-core AVX2 development machine (float32, the `bench`
    # preset, 128-token contexts, K=4 forced proposals; median step times, machine under load): a verification
    # step costs 3.3x a decode step at batch 1 (a one-row matmul is a GEMV, K+1 rows a GEMM), 1.6x at 4, 1.1-1.5x
    # at 8-32; where proposals come from a copy (acceptance ~0.99 on SmolLM2 quoting a passage) each step yields
    # ~5 tokens, but proposals on ordinary text are mostly rejected, and at 32 sequences such rejected work
    # (K tokens per sequence) is what makes a step compute-bound. 8 keeps batch-32 serving as it was
    # (`bench throughput --num-prompts 32 --speculative-config ...`) and speculation for the low-batch case.
    disable_by_batch_size: int = Field(default=8, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _check_method(cls, data):
        if not isinstance(data, dict):
            return data
        method = data.get("method")
        if method is None:  # vLLM: a draft model implies its method; anything else must be named
            if data.get("model") is None:
                raise ValueError('speculative decoding needs a "method" ("ngram") or a draft "model"')
            data = dict(data, method="draft_model")
        elif method == "deepseek_mtp":  # vLLM's older name of the same method
            data = dict(data, method="mtp")
        elif method not in ("ngram", "draft_model", "mtp"):
            raise ValueError(f"speculative method {method!r} is not supported; this engine implements 'ngram' "
                             "(prompt lookup), 'draft_model' (a smaller model with the same tokenizer) and 'mtp' "
                             "(the target checkpoint's own multi-token-prediction layer)")
        return data

    @model_validator(mode="after")
    def _check(self) -> "SpeculativeConfig":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative method "draft_model" needs the draft "model"')
        if self.method == "ngram" and self.model is not None:
            raise ValueError('speculative method "ngram" takes no "model" (a draft model implies "draft_model")')
        if self.method == "mtp" and self.model is not None:
            raise ValueError('speculative method "mtp" takes no "model": the MTP layer is read from the target '
                             "model's own checkpoint")
        return self


class PoolerConfig(BaseModel):
    """How an embedding request's vector is made (vLLM's --pooler-config JSON): which final hidden states are pooled
    and whether the vector is L2-normalized. Unset fields come from the model's sentence-transformers files
    (modules.json, 1_Pooling/config.json) where present, else the defaults: LAST for decoders, MEAN for encoders,
    normalized."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pooling_type: PoolingType | None = Field(
        default=None, description="LAST: the last prompt token's hidden state; MEAN: the mean over the prompt's "
                                  "tokens; CLS: the first token's")
    normalize: bool | None = Field(default=None, description="L2-normalize the pooled vector")

    @field_validator("pooling_type", mode="before")
    @classmethod
    def _upper(cls, value):
        return value.upper() if isinstance(value, str) else value


def parse_json_object(flag: str):
    """A parser of a flag whose value is a JSON object (its fields are checked by the config model)."""

    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{flag} is not valid JSON ({e}): {text!r}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON object, got {text!r}")
        return value

    return parse


# the --speculative-config JSON object (its fields are checked by SpeculativeConfig)
parse_speculative_config = parse_json_object("--speculative-config")


class MultiModalLimits(BaseModel):
    """--limit-mm-per-prompt (vLLM's JSON object): the most items of each modality one prompt may carry."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image: int = Field(default=4, ge=0, description="images per prompt (vision-language models)")


class KVEventsConfig(BaseModel):
    """KV events (vLLM's --kv-events-config JSON): the prefix cache's stored / removed / cleared blocks, published
    over ZMQ in vLLM's wire format (engine/core/kv_events.py) for KV-cache-aware routers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_kv_cache_events: bool = Field(default=False, description="publish the events")
    publisher: Literal["null", "zmq"] | None = Field(
        default=None, description='"zmq", or "null" (publish nothing); default: zmq when events are enabled')
    endpoint: str = Field(default="tcp://*:5557", description="the ZMQ PUB address (bound when it has * or ::)")
    replay_endpoint: str | None = Field(default=None, description="a ZMQ ROUTER address where subscribers ask for "
                                                                  "missed batches by sequence number")
    buffer_steps: int = Field(default=10_000, gt=0, description="batches kept for replay")
    hwm: int = Field(default=100_000, gt=0, description="the PUB socket's high-water mark")
    max_queue_size: int = Field(default=100_000, gt=0, description="batches waiting to be sent; more are dropped "
                                                                   "(a sequence gap) rather than stall a step")
    topic: str = Field(default="", description="the topic every message carries")

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


class KVTransferConfig(BaseModel):
    """Prefill/decode disaggregation (vLLM's --kv-transfer-config JSON): a producer engine prefills prompts and
    serves their KV blocks by block hash; a consumer engine, given a request's `kv_transfer_params`, pulls the
    prompt's blocks from the producer before it schedules the request (engine/core/kv_transfer.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kv_connector: str = Field(description='the transport: "ShoalConnector" (KV blocks over the engines\' HTTP port)')
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] = Field(
        description="kv_producer serves its prompts' KV, kv_consumer pulls it, kv_both does either")
    kv_buffer_size: float = Field(default=1e9, gt=0, description="bytes of host memory a consumer keeps pulled blocks "
                                                               "in until its prefill reads them (when it has no "
                                                               "--kv-offloading-size tier to put them in)")
    engine_id: str | None = Field(default=None, description="this engine's name in the kv_transfer_params it returns "
                                                            "(default: a random one per process)")
    kv_connector_extra_config: dict[str, Any] = Field(
        default_factory=dict, description='{"pull_timeout": seconds (default 10): how long a consumer waits for a '
                                          'producer before it prefills the prompt itself; "hold_seconds": seconds '
                                          '(default 30): how long a producer keeps a prefill\'s blocks for the pull}')

    @field_validator("kv_connector")
    @classmethod
    def _known_connector(cls, value: str) -> str:
        if value != "ShoalConnector":
            raise ValueError(f"kv_connector {value!r} is not available in Shoal: only 'ShoalConnector' (KV blocks "
                             "between Shoal engines over their HTTP port); NIXL, LMCache and Mooncake are not built in")
        return value

    @field_validator("kv_connector_extra_config")
    @classmethod
    def _extra(cls, value: dict) -> dict:
        unknown = set(value) - {"pull_timeout", "hold_seconds"}
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown key(s) {sorted(unknown)}; known: hold_seconds, "
                             "pull_timeout")
        for key in ("pull_timeout", "hold_seconds"):
            seconds = value.get(key, 1.0)
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
                raise ValueError(f"kv_connector_extra_config.{key} must be a positive number of seconds, got "
                                 f"{seconds!r}")
        return value

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def pull_timeout(self) -> float:
        return float(self.kv_connector_extra_config.get("pull_timeout", 10.0))

    @property
    def hold_seconds(self) -> float:
        return float(self.kv_connector_extra_config.get("hold_seconds", 30.0))


class EngineConfig(BaseModel):
    """Every engine option. A field with a Flag is a `shoal-engine serve` flag (shoal.engine.flags derives it)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: Annotated[str, Flag(
        MODEL, "local Hugging Face model directory, a hub id present in the local HF cache, or a .gguf file (config, "
               "tokenizer and chat template from its metadata). Without it, the demo model: SmolLM2-135M-Instruct "
               "if on this machine ($SHOAL_DEMO_GGUF or fetched by `shoal-engine demo`), else a tiny random-weight "
               "model.")]
    served_model_name: Annotated[str | None, Flag(MODEL, "the model name clients use (default: --model)")] = None
    tokenizer: Annotated[str | None, Flag(
        MODEL, "tokenizer directory, id or .gguf file (default: the model's; for a GGUF model, its metadata)")] = None
    revision: Annotated[str | None, Flag(MODEL, "model revision (hub ids only)")] = None
    trust_remote_code: Annotated[bool, Flag(MODEL, "allow custom code from the model directory")] = False
    chat_template: Annotated[str | None, Flag(
        MODEL, "a Jinja chat template file (or inline template) for models without one")] = None
    dtype: Annotated[Dtype, Flag(
        MODEL, "auto | float16 (half) | bfloat16 | float32 (float); auto: the checkpoint's dtype (float16 "
               "checkpoints run as bfloat16 on CPU)", type=parse_dtype)] = "auto"
    quantization: Annotated[Literal["int8", "int4", "fp8"] | None, Flag(
        MODEL, "quantize linear weights on load: int8 (per-channel weights, dynamic per-token int8 activations), "
               "int4 (group-wise, weight-only), fp8 (e4m3; CUDA, compute capability >= 8.9)", aliases=("-q",))] = None
    seed: Annotated[int, Flag(MODEL, "random seed")] = 0

    device: Annotated[Literal["auto", "cpu", "cuda"], Flag(ENGINE, "where the model runs")] = "auto"
    tensor_parallel_size: Annotated[int, Flag(
        ENGINE, "ranks each layer's weights are split over", aliases=("-tp",))] = Field(default=1, gt=0)
    pipeline_parallel_size: Annotated[int, Flag(
        ENGINE, "pipeline stages the layers are split over", aliases=("-pp",))] = Field(default=1, gt=0)
    max_model_len: Annotated[int | None, Flag(
        ENGINE, "context length (prompt + output); default: the model's", type=parse_len)] = Field(
        default=None, gt=0)
    max_num_seqs: Annotated[int, Flag(ENGINE, "maximum sequences per step")] = Field(default=256, gt=0)
    max_num_batched_tokens: Annotated[int | None, Flag(
        ENGINE, "token budget per step", type=parse_len)] = Field(default=None, gt=0)
    block_size: Annotated[int, Flag(ENGINE, "tokens per KV-cache block")] = Field(default=16, gt=0, le=256)
    gpu_memory_utilization: Annotated[float, Flag(
        ENGINE, "fraction of GPU memory for weights, activations and KV cache (GPU only)")] = Field(
        default=0.9, gt=0.0, le=1.0)
    kv_cache_memory: Annotated[int | None, Flag(
        ENGINE, f"KV cache size in bytes; this is how the KV cache is sized on CPU (default "
                f"{DEFAULT_CPU_KV_CACHE_BYTES // 2**20}MiB). Accepts suffixes: 512MiB, 2GiB, 1.5G (binary), 2GB "
                "(decimal). On GPU it overrides --gpu-memory-utilization.", type=parse_bytes)] = Field(
        default=None, gt=0)
    kv_cache_dtype: Annotated[Literal["auto", "fp8"], Flag(
        ENGINE, "KV cache storage: auto (the model dtype) or fp8 (float8 e4m3 with a float32 scale per token and kv "
                "head, computed as the cache is written: ~0.53x the bytes of bf16 at head_dim 64, so the same "
                "--kv-cache-memory holds ~1.9x the tokens; read by the cpu, sdpa, triton and flash backends)")] = "auto"
    num_kv_blocks: Annotated[int | None, Flag(
        ENGINE, "pin the KV pool to exactly this many blocks (overrides the size above)")] = Field(default=None, gt=0)
    enable_prefix_caching: Annotated[bool, Flag(ENGINE, "reuse KV blocks of shared prompt prefixes")] = True
    kv_offloading_size: Annotated[float | None, Flag(
        ENGINE, "GiB of host memory for KV blocks evicted from the KV cache (vLLM's flag; summed over the ranks of "
                "a parallel group): a prefix the cache lost is read back from there instead of recomputed. Needs "
                "prefix caching", metavar="GIB")] = Field(default=None, gt=0)
    kv_offloading_backend: Annotated[str, Flag(
        ENGINE, "the KV offloading implementation (vLLM's flag); Shoal has native only",
        metavar="native")] = "native"
    kv_offloading_disk_path: Annotated[str | None, Flag(
        ENGINE, "a local directory for a second offload tier, fed by the host-memory tier's least recently used "
                "blocks (one file per block, checksummed; emptied at start: it does not survive a restart). "
                "Needs --kv-offloading-size and --kv-offloading-disk-size", metavar="DIR")] = Field(
        default=None, min_length=1)
    kv_offloading_disk_size: Annotated[float | None, Flag(
        ENGINE, "GiB of --kv-offloading-disk-path the disk tier may fill (summed over the ranks)",
        metavar="GIB")] = Field(default=None, gt=0)
    enable_chunked_prefill: Annotated[bool, Flag(ENGINE, "split long prompts over several steps")] = True
    attention_backend: Annotated[AttentionBackend, Flag(
        ENGINE, "auto: flash > triton > sdpa on CUDA, cpu (C++ paged kernel) > sdpa on CPU")] = "auto"
    enforce_eager: Annotated[bool, Flag(ENGINE, "no CUDA graphs (never capture decode steps)")] = False
    enable_sleep_mode: Annotated[bool, Flag(
        ENGINE, "allow POST /sleep?level=1|2 and POST /wake_up: level 1 frees the KV cache and keeps the weights "
                "(in host memory on a GPU), level 2 drops the weights too and reloads them on wake-up")] = False
    enable_expert_parallel: Annotated[bool, Flag(
        ENGINE, "mixture-of-experts models: place whole experts on the ranks of each tensor-parallel group (experts / "
                "tp per rank) instead of splitting every expert's width across them (layers/moe.py)")] = False
    decode_capture: Literal["auto", "cuda-graph", "cpu-graph", "eager", "none"] = Field(
        default="auto", description="decode capture backend; auto: cuda-graph on CUDA, cpu-graph on CPU "
                                    "(execution/graph_capture.py)")
    max_queue_len: Annotated[int, Flag(ENGINE, "waiting requests beyond this are refused with 429")] = Field(
        default=1024, gt=0)
    scheduling_policy: Annotated[Literal["fcfs", "priority"], Flag(
        ENGINE, "fcfs: first come, first served; priority: lowest request priority value first, then arrival")] = "fcfs"

    speculative_config: Annotated[SpeculativeConfig | None, Flag(
        ENGINE, 'speculative decoding as a JSON object, e.g. {"method": "ngram", "num_speculative_tokens": 4, '
                '"prompt_lookup_max": 4, "prompt_lookup_min": 2}; "disable_by_batch_size" (default 8) switches it off '
                'for steps with more decoding sequences; or a draft model with the same tokenizer: '
                '{"model": DIR, "num_speculative_tokens": 4}; or a DeepSeek V3 checkpoint\'s own MTP layer: '
                '{"method": "mtp", "num_speculative_tokens": 1}', type=parse_speculative_config, metavar="JSON")] = None
    runner: Annotated[Runner, Flag(
        ENGINE, "auto: a causal LM generates and also serves /v1/embeddings (its prompt's hidden states pooled, see "
                "--pooler-config), an encoder-only model (BertModel) serves /v1/embeddings only; generate: no "
                "/v1/embeddings; pooling: /v1/embeddings only (completions and chat are refused)")] = "auto"
    pooler_config: Annotated[PoolerConfig | None, Flag(
        ENGINE, 'pooling of /v1/embeddings as a JSON object: {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": '
                'true | false}; unset fields come from the model\'s sentence-transformers files, else LAST (decoders) '
                'or MEAN (encoders), normalized', type=parse_json_object("--pooler-config"), metavar="JSON")] = None
    limit_mm_per_prompt: Annotated[MultiModalLimits | None, Flag(
        ENGINE, 'the most images one prompt may carry, as a JSON object (vLLM\'s flag), e.g. {"image": 2}; default '
                '{"image": 4}; vision-language models only', type=parse_json_object("--limit-mm-per-prompt"),
        metavar="JSON")] = None
    allowed_media_domains: Annotated[list[str] | None, Flag(
        MEDIA, "hostnames image_url http(s) URLs may be fetched from (vLLM's flag; exact names, e.g. "
               "upload.wikimedia.org). Unset: fetching is off and only base64 data: URLs are taken (vLLM fetches "
               "from anywhere when it is unset). A redirect is followed only to another listed host, up to 5 hops",
        nargs="+", metavar="HOST")] = None
    media_fetch_timeout: Annotated[float, Flag(
        MEDIA, "seconds one image URL may take, redirects, connecting and reading the body included (vLLM's "
               "VLLM_IMAGE_FETCH_TIMEOUT)", metavar="SECONDS")] = Field(default=5.0, gt=0, le=600)
    media_fetch_max_bytes: Annotated[int, Flag(
        MEDIA, "the most bytes one fetched image may have (enforced while reading; after content decoding)",
        type=parse_bytes)] = Field(default=20 * 1024 * 1024, gt=0)
    media_fetch_allow_private_addresses: Annotated[bool, Flag(
        MEDIA, "let a listed host resolve to a loopback, private (RFC 1918, ULA) or shared (100.64/10) address, "
               "e.g. an in-cluster image store; without it such a host is refused (SSRF). Link-local, metadata, "
               "multicast and unspecified addresses are refused always")] = False
    max_image_pixels: Annotated[int, Flag(
        MEDIA, "the most pixels (width x height) one image may have, data: URL or fetched; read from the image "
               "header before it is decoded. Default 4096x4096")] = Field(default=4096 * 4096, gt=0)
    kv_events_config: Annotated[KVEventsConfig | None, Flag(
        ENGINE, 'KV-cache events for KV-aware routers, vLLM\'s format, as a JSON object, e.g. '
                '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                '"replay_endpoint": "tcp://*:5558", "topic": "kv"}', type=parse_json_object("--kv-events-config"),
        metavar="JSON")] = None
    kv_transfer_config: Annotated[KVTransferConfig | None, Flag(
        ENGINE, 'prefill/decode disaggregation, vLLM\'s flag, as a JSON object: {"kv_connector": "ShoalConnector", '
                '"kv_role": "kv_producer"|"kv_consumer"|"kv_both"}. A producer answers a request carrying '
                'kv_transfer_params {"do_remote_decode": true} with the kv_transfer_params a consumer needs to pull '
                'the prompt\'s KV from it; needs prefix caching', type=parse_json_object("--kv-transfer-config"),
        metavar="JSON")] = None
    enable_lora: Annotated[bool, Flag(
        LORA, "serve LoRA adapters (PEFT directories) of the base model; one batch mixes adapters and the base "
              "model; clients name an adapter as `model`")] = False
    lora_modules: Annotated[list[str] | None, Flag(
        LORA, "adapters to register at start-up, as name=path (PEFT adapter directories)", nargs="+",
        metavar="NAME=PATH")] = None
    max_loras: Annotated[int, Flag(LORA, "adapters in one batch (device slots)")] = Field(default=1, gt=0)
    max_lora_rank: Annotated[int, Flag(LORA, "the highest adapter rank accepted")] = Field(default=16, gt=0)
    max_cpu_loras: Annotated[int | None, Flag(
        LORA, "adapters kept loaded (least recently used evicted; default: --max-loras)")] = Field(default=None,
                                                                                                 gt=0)

    distributed: DistributedConfig = Field(default_factory=DistributedConfig)

    @field_validator("speculative_config", "pooler_config", "kv_events_config", "kv_transfer_config",
                     "limit_mm_per_prompt", mode="before")
    @classmethod
    def _parse_json_config(cls, value):
        return json.loads(value) if isinstance(value, str) else value

    @field_validator("allowed_media_domains")
    @classmethod
    def _check_media_domains(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        out = []
        for entry in value:
            host = entry.strip().rstrip(".").lower()
            if not _HOSTNAME.match(host) and not _is_ip(host):
                raise ValueError(f"allowed_media_domains entry {entry!r} must be a hostname or an IP address, without "
                                 "a scheme, port or path (e.g. upload.wikimedia.org)")
            out.append(host)
        if not out:
            raise ValueError("allowed_media_domains must list at least one hostname (leave it unset to keep fetching "
                             "off)")
        return out

    @field_validator("kv_offloading_backend")
    @classmethod
    def _check_offloading_backend(cls, value: str) -> str:
        if value != "native":
            raise ValueError(f"kv_offloading_backend {value!r} is not available in Shoal: only 'native' (the engine's "
                             "own CPU and disk tiers); LMCache and Mooncake are not built in")
        return value

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.kv_offloading_disk_path is not None and self.kv_offloading_disk_size is None:
            raise ValueError("kv_offloading_disk_path needs kv_offloading_disk_size (GiB the disk tier may fill)")
        if self.kv_offloading_disk_size is not None and self.kv_offloading_disk_path is None:
            raise ValueError("kv_offloading_disk_size needs kv_offloading_disk_path (the directory of the disk tier)")
        if self.kv_offloading_disk_path is not None and self.kv_offloading_size is None:
            raise ValueError("the disk tier takes what the host-memory tier lets go: kv_offloading_disk_path needs "
                             "kv_offloading_size")
        if self.kv_transfer_config is not None and not self.enable_prefix_caching:
            raise ValueError("kv_transfer_config moves a prompt's KV blocks by their prefix-cache hashes: it needs "
                             "prefix caching (drop --no-enable-prefix-caching)")
        if self.kv_offloading_size is not None and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size keeps evicted prefix-cache blocks: it needs prefix caching (drop "
                             "--no-enable-prefix-caching)")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least block_size ({self.block_size})"
            )
        for entry in self.lora_modules or []:
            name, sep, path = entry.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules entry {entry!r} must be name=path")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        spec = self.speculative_config
        if self.enable_sleep_mode and spec is not None and spec.method in ("draft_model", "mtp"):
            raise ValueError(f"enable_sleep_mode does not support the speculative method {spec.method!r} (its own KV "
                             "cache and weights are not released by sleep); use the ngram method or leave sleep "
                             "mode off")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        d = self.distributed
        if self.world_size % d.nnodes:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} x pipeline_parallel_size "
                             f"{self.pipeline_parallel_size} is not divisible by nnodes {d.nnodes}")
        if d.layer_partition is not None and len(d.layer_partition) != self.pipeline_parallel_size:
            raise ValueError(f"layer_partition {d.layer_partition} must give one layer count per pipeline stage "
                             f"({self.pipeline_parallel_size})")
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def lora_paths(self) -> dict[str, str]:
        """{adapter name: path} of --lora-modules."""
        return dict(e.partition("=")[::2] for e in self.lora_modules or [])

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size
