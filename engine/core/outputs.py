"""What the engine hands back: vLLM's RequestOutput / CompletionOutput shapes, so users' scripts port.

How much each output carries is the request's `SamplingParams.output_kind` (RequestOutputKind, in contracts.py):
CUMULATIVE (everything so far, every step), DELTA (only what is new since the previous output: the server's
streaming mode) or FINAL_ONLY (one cumulative output when the request finishes: the offline `LLM`). Deltas of
one request add up with `RequestOutput.add`, so a slow reader can merge several into one.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-N alternatives).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing precedes it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str  # safe to show: no partial UTF-8, no pending stop-string prefix (new text only, in DELTA mode)
    token_ids: list[int]  # generated token ids (new ones only, in DELTA mode)
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: "CompletionOutput") -> None:
        """Append a later delta of the same completion."""
        self.text += delta.text
        self.token_ids = self.token_ids + delta.token_ids
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        self.cumulative_logprob = delta.cumulative_logprob
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason


@dataclass
class RequestMetrics:
    """The one timing record of a request (time.time() seconds), kept by the engine as the request runs."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0  # over all n completions
    inter_token_latency: float | None = None  # between the latest step's tokens and the previous step's


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # in the first output only, in DELTA mode
    extra: dict = field(default_factory=dict)
    # An embedding request's vector (a float32 CPU torch.Tensor), in its one, finished output; None otherwise.
    embedding: object = None

    def add(self, delta: "RequestOutput") -> None:
        """Merge a later DELTA output of the same request into this one (completions matched by index)."""
        by_index = {c.index: c for c in self.outputs}
        for c in delta.outputs:
            if c.index in by_index:
                by_index[c.index].add(c)
            else:
                by_index[c.index] = CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                                                     list(c.logprobs) if c.logprobs is not None else None,
                                                     c.finish_reason, c.stop_reason)
        self.outputs = [by_index[i] for i in sorted(by_index)]
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.finished = delta.finished
        self.metrics = delta.metrics or self.metrics
        self.num_cached_tokens = delta.num_cached_tokens
