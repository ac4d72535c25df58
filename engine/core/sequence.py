"""Per-request state: a Request owns n Sequences (one per completion), each with its tokens and KV blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from shoal.engine.contracts import SamplingParams
from shoal.engine.core.outputs import Logprob, RequestMetrics


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request: "Request"
    index: int  # completion index within the request
    token_ids: list[int]  # prompt then generated tokens
    num_prompt_tokens: int
    images: object = None  # a core.images.PromptImages when the prompt holds images (vision-language models)
    generator: torch.Generator | None = None
    detokenizer: object = None
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose keys/values are in the cache
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of the leading full, computed blocks
    # Leading blocks given back because they slid out of every layer's attention window (models whose layers are
    # all windowed): their entries in block_ids are 0 (never read, never published to the prefix cache).
    num_freed_blocks: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at (last) admission
    state_slot: int | None = None  # hybrid models: the recurrent-state slot it holds while running (StatePool)
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # What the last output left to send (DELTA outputs): generated tokens already emitted, and text released by
    # the detokenizer since.
    num_sent_tokens: int = 0
    unsent_text: str = ""
    finish_sent: bool = False
    grammar: object = None  # a structured_outputs.GrammarMatcher when the request is grammar-constrained
    # Speculative decoding: tokens proposed to follow token_ids this step (engine/core/speculative.py); the
    # scheduler decides how many of them are verified (ScheduledSeq.num_draft).
    spec_token_ids: list[int] = field(default_factory=list)
    # A draft model's proposals: the distribution each was drawn from (None: greedy, a point mass), and how many
    # leading positions hold valid draft keys/values (DraftModelProposer).
    spec_probs: list = field(default_factory=list)
    num_draft_computed: int = 0
    # A hybrid whose proposals were rejected: its next step starts from the state backed up before them.
    state_rollback: bool = False
    # Embedding requests: the pooled hidden states so far (a sum over the prompt's chunks, for MEAN pooling).
    pooled: torch.Tensor | None = None

    @property
    def prompt_scored_upto(self) -> int | None:
        """When this sequence still owes prompt logprobs: the position up to which they exist (the prefix cache may
        serve only positions before it). None when it owes none (only completion 0 of a request scores the
        prompt)."""
        plp = self.request.prompt_logprobs
        if self.index != 0 or plp is None or len(plp) >= self.num_prompt_tokens:
            return None
        return max(0, len(plp) - 1)

    @property
    def pooling(self):
        """The request's resolved PoolingParams when it is an embedding request (None: it generates)."""
        return self.request.pooling

    @property
    def held_block_ids(self) -> list[int]:
        """The blocks this sequence references (block_ids less the leading ones freed by a sliding window)."""
        return self.block_ids[self.num_freed_blocks:]

    @property
    def lora_id(self) -> int | None:
        """The id of the LoRA adapter this sequence runs under (None: the base model)."""
        lora = self.request.lora
        return None if lora is None else lora.id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics  # the request's timing record
    priority: int = 0
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list | None = None  # one entry per prompt token scored so far (the first is None)
    prompt_logprobs_sent: bool = False
    lora: object = None  # a core.lora.LoRARequest when the request runs under an adapter
    # An embedding request's PoolingParams, every field resolved (pooling_type, normalize set): its prompt is
    # prefilled (chunked under the same token budget as any prompt), pooled, and nothing is generated.
    pooling: object = None

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
