"""EngineConfig: every knob of the engine in one validated place (the CLI and LLM() both build one).

DistributedConfig is the part a multi-process group needs before any model is known: how a rank finds its group
and notices failures. It travels inside EngineConfig (`config.distributed`), on its own to a --headless node and
to every worker process (as JSON on its command line).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_CPU_KV_CACHE_BYTES = 512 * 1024 * 1024  # 512 MiB on CPU unless --kv-cache-memory says otherwise


class DistributedConfig(BaseModel):
    """How this process joins its tensor/pipeline-parallel group (flags: --nnodes, --node-rank, --master-addr,
    --master-port, --distributed-*, --heartbeat-timeout, --pipeline-*). The defaults suit one machine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nnodes: int = Field(default=1, gt=0, description="nodes (pods) in the group")
    node_rank: int = Field(default=0, ge=0, description="this node's index; node 0 runs rank 0 and the API")
    master_addr: str = "127.0.0.1"
    master_port: int | None = Field(default=None, gt=0, lt=65536,
                                    description="rendezvous port; None: a free port on one node, 29500 on several")
    backend: Literal["nccl", "gloo"] | None = Field(default=None, description="None: nccl on CUDA, gloo on CPU")
    startup_timeout: float = Field(default=600.0, gt=0, description="seconds ranks wait for each other at start")
    collective_timeout: float = Field(default=20.0, gt=0, description="seconds a collective or send/recv may wait")
    heartbeat_interval: float = Field(default=1.0, gt=0)
    heartbeat_timeout: float = Field(default=10.0, gt=0, description="seconds without a heartbeat: rank failed")
    exit_on_failure: bool = Field(default=False, description="rank 0 exits 1 after exit_grace once a rank failed "
                                                             "(serving); the offline LLM raises instead")
    exit_grace: float = Field(default=2.0, ge=0)
    micro_batches: int | None = Field(default=None, gt=0,
                                      description="pipeline micro-batches per step; None: one per stage")
    layer_partition: list[int] | None = Field(default=None, description="decoder layers per pipeline stage")

    @model_validator(mode="after")
    def _check(self) -> "DistributedConfig":
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be in [0, nnodes {self.nnodes})")
        if self.layer_partition is not None and min(self.layer_partition, default=0) < 1:
            raise ValueError(f"layer_partition {self.layer_partition} must list positive layer counts")
        return self


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str = Field(description="local Hugging Face directory or a hub id present in the local HF cache")
    tokenizer: str | None = None
    revision: str | None = None
    served_model_name: str | None = None
    trust_remote_code: bool = False
    chat_template: str | None = None

    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    quantization: Literal["int8", "int4", "fp8"] | None = Field(
        default=None, description="quantize linear weights on load (int8 W8A8, int4 weight-only, fp8 on GPU)")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0

    max_model_len: int | None = Field(default=None, gt=0)
    max_num_seqs: int = Field(default=256, gt=0)
    max_num_batched_tokens: int | None = Field(default=None, gt=0)
    enable_chunked_prefill: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    max_queue_len: int = Field(default=1024, gt=0, description="waiting requests beyond this are refused")

    block_size: int = Field(default=16, gt=0, le=256)
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    kv_cache_memory: int | None = Field(default=None, gt=0, description="KV cache size in bytes (CPU default 512 MiB)")
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        default="auto", description="auto: the model dtype; fp8: float8 e4m3 values with a float32 scale per token "
                                    "and kv head (about half the bytes of bf16, so ~1.9x the blocks)")
    num_kv_blocks: int | None = Field(default=None, gt=0, description="pin the KV pool to this many blocks")
    enable_prefix_caching: bool = True

    attention_backend: Literal["auto", "sdpa", "triton", "flash", "cpu"] = "auto"
    enforce_eager: bool = Field(default=False, description="never capture decode steps (graph_capture.py)")
    decode_capture: Literal["auto", "cuda-graph", "eager", "none"] = Field(
        default="auto", description="decode capture backend; auto: cuda-graph on CUDA, none on CPU")

    tensor_parallel_size: int = Field(default=1, gt=0)
    pipeline_parallel_size: int = Field(default=1, gt=0)
    enable_expert_parallel: bool = Field(
        default=False, description="MoE layers: the ranks of a tensor-parallel group hold whole experts (experts / "
                                   "tp each) instead of a 1/tp slice of every expert (layers/moe.py)")
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least block_size ({self.block_size})"
            )
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
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size
