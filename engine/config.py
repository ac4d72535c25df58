"""EngineConfig: every knob of the engine in one validated place (the CLI and LLM() both build one)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_CPU_KV_CACHE_BYTES = 512 * 1024 * 1024  # 512 MiB on CPU unless --kv-cache-memory says otherwise


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str = Field(description="local Hugging Face directory or a hub id present in the local HF cache")
    tokenizer: str | None = None
    revision: str | None = None
    served_model_name: str | None = None
    trust_remote_code: bool = False
    chat_template: str | None = None

    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
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
    num_kv_blocks: int | None = Field(default=None, gt=0, description="pin the KV pool to this many blocks")
    enable_prefix_caching: bool = True

    attention_backend: Literal["auto", "sdpa", "triton", "flash", "cpu"] = "auto"
    enforce_eager: bool = Field(default=False, description="never capture decode steps (graph_capture.py)")
    decode_capture: Literal["auto", "cuda-graph", "eager", "none"] = Field(
        default="auto", description="decode capture backend; auto: cuda-graph on CUDA, none on CPU")

    tensor_parallel_size: int = Field(default=1, gt=0)
    pipeline_parallel_size: int = Field(default=1, gt=0)

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least block_size ({self.block_size})"
            )
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size
