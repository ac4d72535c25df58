"""The data contracts between the engine loop (core/) and the model execution (execution/, distributed/).

Both sides import this module and nothing of each other's in the other direction: core/ plans and hands over
these types, execution/ consumes them and never imports core/ (tests/engine/test_import_graph.py checks it).

  RequestOutputKind  how much of a request's output each step reports (vLLM's names)
  SamplingParams     one request's sampling parameters (vLLM's names, defaults and checks)
  PoolingParams      one embedding request's pooling (vLLM's PoolingParams names): the prompt's hidden states
                     pooled into one vector instead of generating
  StepImage          the slice of one image's tokens a step prefills (vision-language models)
  StepInputs         one step's whole plan in plain tensors: what the scheduler's choice becomes, what every model
                     runner executes, and what rank 0 sends to the other ranks of a multi-process engine
  DraftRequest       one decoding sequence a draft model proposes tokens for (speculative decoding), and
  DraftProposal      what the executor's draft model proposed for it
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass

import torch

_SAMPLING_EPS = 1e-5  # temperature below this is greedy (vLLM's threshold)
MAX_N = 128  # cap on n (completions per request)
MAX_LOGPROBS = 20  # cap on logprobs (top alternatives per token), as OpenAI's top_logprobs

class RequestOutputKind(enum.Enum):
    """CUMULATIVE: everything so far, every step; DELTA: only what is new since the previous output (the
    server's streaming mode); FINAL_ONLY: one cumulative output when the request finishes (the offline LLM)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """Per-request sampling parameters; vLLM's names, defaults and meanings.

    `SamplingParams(temperature=0, max_tokens=8)` is greedy decoding of at most 8 tokens. Invalid values raise
    ValueError naming the parameter and its allowed range.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None  # top-N alternatives per prompt token (vLLM's); 0: only the token's own
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Grammar-constrained decoding: a StructuredOutputsParams (what to enforce) or an already compiled grammar
    # (shoal.engine.core.structured_outputs.CompiledGrammar); None: unconstrained.
    structured_outputs: object | None = None

    def __post_init__(self) -> None:
        # Normalise.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the truncation knobs mean nothing; reset them so no sort/mask work is done for this row.
            self.temperature = 0.0
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    def _verify(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}.")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"an integer in [1, {MAX_N}]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2.0 <= v <= 2.0:
                raise bad(name, "in [-2, 2]")
        if not is_num(self.repetition_penalty) or not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "greater than 0")
        if not is_num(self.temperature) or not self.temperature >= 0.0 or self.temperature == float("inf"):
            raise bad("temperature", "a finite number >= 0")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "-1 or 0 (disabled) or a positive integer")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", "an integer or None")
        # max_tokens=0 scores the prompt without generating (with prompt_logprobs; the completions API's echo)
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 0):
            raise bad("max_tokens", "an integer >= 0 or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"an integer in [0, {MAX_LOGPROBS}] or None")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise bad("prompt_logprobs", f"an integer in [0, {MAX_LOGPROBS}] or None")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain only non-empty strings, got {self.stop!r}.")
        for t in self.stop_token_ids:
            if not is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must contain only non-negative integers, got {self.stop_token_ids!r}.")

    # ---- derived -------------------------------------------------------------------------------------------
    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def clone(self, **changes) -> "SamplingParams":
        """A copy (lists copied too), optionally with some fields changed (validated again)."""
        if changes:
            d = {k: v if k == "structured_outputs" else copy.copy(v) for k, v in self.__dict__.items()}
            d.update(changes)
            return SamplingParams(**d)
        new = copy.copy(self)
        new.stop = list(self.stop)
        new.stop_token_ids = list(self.stop_token_ids)
        return new


POOLING_TYPES = ("LAST", "MEAN", "CLS")  # last token, mean over the prompt, first token (vLLM's names)


@dataclass
class PoolingParams:
    """An embedding request: pool the final hidden states of the prompt into one vector. None fields take the
    engine's pooler configuration (--pooler-config, else the model's sentence-transformers files, else the
    default); `dimensions` keeps the first N components (Matryoshka models only), renormalized when normalizing."""

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}.")
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"dimensions must be a positive integer, got {d!r}.")


@dataclass(eq=False)
class StepImage:
    """Rows [row, row + end - start) of a step's flat batch are tokens [start, end) of one image: the runner puts the
    image's encoder features [start, end) there in place of the placeholder tokens' embeddings. `digest` keys the
    encoder-output cache (the same image is encoded once while its features are kept)."""

    row: int
    start: int
    end: int
    digest: bytes
    pixel_values: torch.Tensor  # the model's processor output for this image (LLaVA: [1, C, H, W]; Qwen-VL: patches)
    grid_thw: tuple[int, int, int] | None = None  # Qwen-VL: the image's patch grid (temporal, height, width)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64; [3, T] (M-RoPE's temporal, height, width) in a step with Qwen-VL image rows
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    logits_indices: torch.Tensor  # [S] int64: rows whose next-token logits are needed
    query_lens: list[int]
    seq_lens_list: list[int]
    # Multi-LoRA (--enable-lora): each token's adapter slot ([T] int64, -1 = the base model), None when no token
    # of the step uses an adapter; and the adapter id every slot must hold for this step (None = any).
    lora_token_slots: torch.Tensor | None = None
    lora_slot_ids: list[int | None] | None = None
    # Hybrid models (recurrent layers next to attention): each sequence's recurrent-state slot ([B] int64), None for
    # models without recurrent layers.
    state_slots: torch.Tensor | None = None
    # Hybrid prefix caching, per sequence ([B] int64, -1 = none): the checkpoint slot whose state the sequence starts
    # this step from (copied before the step), and the one its state is copied into after the step.
    state_restore: torch.Tensor | None = None
    state_save: torch.Tensor | None = None
    # Speculative decoding on a hybrid, per sequence ([B] int64, -1 = none): the slot its state is copied into before
    # a step that verifies proposals, so that a rejection can start the sequence again from it (core/scheduler.py).
    state_backup: torch.Tensor | None = None
    # Embedding requests: [start, end) rows of the flat batch whose final hidden states are summed into one vector
    # each (a LAST or CLS pooler's range is one row; MEAN's a whole prompt chunk). None: nothing is pooled.
    pool_ranges: list[tuple[int, int]] | None = None
    # Vision-language models: the image token slices this step prefills, None when it has none.
    images: list[StepImage] | None = None
    # Families whose image tokens attend to their whole image (Gemma 3): (sequence index in the step, first position,
    # one past the last) of each image this step's queries reach into; None: plain causal attention everywhere.
    image_spans: list[tuple[int, int, int]] | None = None

    def to(self, device: torch.device) -> "StepInputs":
        moved = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                 for k, v in self.__dict__.items()}
        return StepInputs(**moved)



@dataclass
class DraftRequest:
    """One decoding sequence a draft model proposes for this step: core/speculative.py asks, the executor's draft
    model (execution/drafter.py) answers. The draft's keys/values live in the sequence's own KV block ids."""

    token_ids: list[int]  # the sequence so far (prompt and output)
    num_computed: int  # leading positions whose draft keys/values are valid (the rest are caught up on first)
    block_ids: list[int]
    num_draft: int  # proposals to make: the scheduler allocated their KV slots
    params: SamplingParams  # greedy: the draft's argmax; else a draw from its softmax at params.temperature
    generator: torch.Generator | None = None  # a seeded request's own generator: its draws come from it


@dataclass
class DraftProposal:
    token_ids: list[int]  # DraftRequest.num_draft of them
    probs: list[torch.Tensor | None]  # the distribution each was drawn from ([vocab] float32); None when greedy
    num_computed: int  # leading positions whose draft keys/values are valid now
