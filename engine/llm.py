"""Offline batch inference like vLLM's: `LLM(model=DIR).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

from shoal.engine.config import EngineConfig
from shoal.engine.contracts import PoolingParams, RequestOutputKind, SamplingParams
from shoal.engine.core.engine import LLMEngine
from shoal.engine.core.outputs import RequestOutput

Prompt = str | dict[str, Any] | list[int]


class LLM:
    """Takes the CLI's options in snake_case (dtype, max_model_len, max_num_seqs, max_num_batched_tokens,
    block_size, enable_prefix_caching, tensor_parallel_size, ...) plus num_kv_blocks to pin the pool size."""

    def __init__(self, model: str, **options: Any):
        self.llm_engine = LLMEngine(EngineConfig(model=str(model), **options))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    @staticmethod
    def _prompt(p: Prompt) -> tuple[str | list[int], list | None]:
        """(the prompt, its images): a dict may carry vLLM's {"multi_modal_data": {"image": one or a list}}."""
        if isinstance(p, str):
            return p, None
        if isinstance(p, dict):
            images = (p.get("multi_modal_data") or {}).get("image")
            if images is not None and not isinstance(images, (list, tuple)):
                images = [images]
            if "prompt_token_ids" in p:
                return list(p["prompt_token_ids"]), images
            if "prompt" in p:
                return p["prompt"], images
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(p, list) and all(isinstance(t, int) for t in p):
            return p, None
        raise TypeError(f"unsupported prompt type {type(p).__name__}: pass a string or {{'prompt_token_ids': [...]}}")

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: str | Sequence[str | None] | None = None
                 ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in input order. use_tqdm: a progress bar on stderr (requests
        finished, prompt and output tokens/s so far), like vLLM's. lora_request: a registered adapter's name for
        every prompt, or one name (None: the base model) per prompt."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = [self._prompt(p) for p in prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, str):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} lora requests for {len(prompts)} prompts")
        params = [sp if sp.output_kind is RequestOutputKind.FINAL_ONLY  # no per-step copies of the outputs
                  else sp.clone(output_kind=RequestOutputKind.FINAL_ONLY) for sp in params]
        return self._run(prompts, params, loras, use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in input order, its `embedding` the pooled vector (a float32
        tensor): the engine's pooling (--pooler-config / the model's sentence-transformers files), `dimensions`
        from pooling_params."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = [self._prompt(p) for p in prompts]
        params = [pooling_params or PoolingParams()] * len(prompts)
        return self._run(prompts, params, [None] * len(prompts), use_tqdm)

    def _run(self, prompts: list, params: list, loras: list, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        progress = _Progress(len(prompts)) if use_tqdm else None
        try:
            for (prompt, images), sp, lora in zip(prompts, params, loras):
                rid = str(next(self._ids))
                engine.add_request(rid, prompt, sp, lora_request=lora, images=images)
                ids.append(rid)
            finished: dict[str, RequestOutput] = {}
            while len(finished) < len(ids):
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if progress is not None:
                            progress.finished(out)
        except BaseException:
            engine.abort_request(ids)  # a failed or interrupted batch leaves no blocks behind
            raise
        finally:
            if progress is not None:
                progress.close()
        return [finished[rid] for rid in ids]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's LLM.reset_prefix_cache); False while requests hold KV blocks."""
        return self.llm_engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class _Progress:
    """A tqdm bar over one generate() call: a tick per finished request, with prompt and output tokens/s."""

    def __init__(self, total: int):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
        self.started = time.perf_counter()
        self.prompt_tokens = self.output_tokens = 0

    def finished(self, out: RequestOutput) -> None:
        self.prompt_tokens += len(out.prompt_token_ids)
        self.output_tokens += sum(len(c.token_ids) for c in out.outputs)
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix_str(f"input {self.prompt_tokens / elapsed:.1f} tok/s, "
                                 f"output {self.output_tokens / elapsed:.1f} tok/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
