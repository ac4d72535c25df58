"""Images under tensor and pipeline parallelism (gloo, worker processes on this machine): a step's image slices
travel to every rank with its plan, each rank runs the (replicated) vision tower for the images its embedding
needs, and pipeline micro-batches carry the slices of their own sequences (and Qwen-VL's 3-D positions, Gemma 3's
bidirectional image spans). Greedy output equals transformers' LLaVA, Qwen-VL, Qwen3.5 and Gemma 3, chunked prefill
across the image's tokens (or, for Gemma 3, between whole images) included."""

from __future__ import annotations

import pytest

from imagekit import hf_gemma3_greedy, hf_llava_greedy, hf_qwen_vl_greedy, make_image, worst_logprob_diff
from shoal.engine import LLM, SamplingParams

pytest.importorskip("PIL")
pytestmark = pytest.mark.slow

MAX_NEW = 6
PROMPTS = [("Hello <image> What is the capital of France?", [make_image(1)]),
           ("<image> and <image> The quick brown fox", [make_image(2), make_image(3, 30, 70)]),
           ("Once upon a time there was", []),
           ("A picture: <image>", [make_image(4)])]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_images_with_parallel_ranks_match_transformers(llava_model, tp, pp):
    # 10 tokens a step: each image's 16 tokens are prefilled over two or three steps, mixed with other sequences'
    # chunks and decodes, so pipeline micro-batches (three) hold image slices at uneven offsets
    with LLM(llava_model, dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp,
             distributed={"micro_batches": 3}, num_kv_blocks=96, block_size=4, max_model_len=96,
             max_num_batched_tokens=10) as llm:
        outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
        for out, (text, images) in zip(outs, PROMPTS):
            prompt, ids = hf_llava_greedy(llava_model, text, images, MAX_NEW)
            assert out.prompt_token_ids == prompt, text
            assert out.outputs[0].token_ids == ids, text
        llm.llm_engine.pool.check_all_free()


def check_with_logprobs(model, reference, prompts, tp: int, pp: int, max_num_batched_tokens: int) -> None:
    """Greedy tokens, prompt ids and every reported logprob (within 2e-4) equal the oracle's at the given layout, in
    three pipeline micro-batches, every KV block free afterwards."""
    with LLM(model, dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp,
             distributed={"micro_batches": 3}, num_kv_blocks=96, block_size=4, max_model_len=96,
             max_num_batched_tokens=max_num_batched_tokens) as llm:
        outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in prompts],
                            SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3),
                            use_tqdm=False)
        assert worst_logprob_diff(reference, model, outs, prompts, MAX_NEW) < 2e-4
        llm.llm_engine.pool.check_all_free()


V = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.mark.parametrize("family, tp, pp", [("qwen_vl_model", 2, 1), ("qwen_vl_model", 1, 2),
                                            ("qwen3_vl_model", 2, 1), ("qwen3_5_vl_model", 2, 1),
                                            ("qwen3_5_vl_model", 1, 2)],
                         ids=["qwen2_5_vl-tp2", "qwen2_5_vl-pp2", "qwen3_vl-tp2", "qwen3_5_vl-tp2", "qwen3_5_vl-pp2"])
def test_qwen_vl_with_parallel_ranks_matches_transformers(request, family, tp, pp):
    # Qwen3.5: the hybrid decoder's Gated DeltaNet heads split over the ranks, its layers over the stages (no
    # deepstack: later stages need nothing from the tower)
    model = request.getfixturevalue(family)
    side = 28 if family == "qwen_vl_model" else 32  # 2x2 merged patches
    prompts = [(f"Hello {V} What is the capital of France?", [make_image(1, 2 * side, 2 * side)]),
               ("Once upon a time there was", []),
               (f"{V} and {V} The quick brown fox", [make_image(2, 4 * side, 3 * side),
                                                     make_image(3, 2 * side, 2 * side)])]
    check_with_logprobs(model, hf_qwen_vl_greedy, prompts, tp, pp, max_num_batched_tokens=10)


G = "<start_of_image>"


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_gemma3_vl_with_parallel_ranks_matches_transformers(gemma3_vl_model, tp, pp):
    # Bidirectional attention inside each image: every rank's SDPA masks its own heads with the step's image spans,
    # and each pipeline micro-batch carries its sequences' spans (re-based). The text-only prompt comes first, so
    # the image sequences sit at later indices of the step (and of a micro-batch). 24 tokens a step: the
    # two-image prompt (58 tokens) is prefilled in chunks that stop between its images (each image whole), mixed
    # with other sequences' chunks and decodes. Dropping the spans on rank 1 (TP) or in the micro-batches (PP)
    # moves the logprobs by 0.03 or more (0.1 at worst).
    prompts = [("Once upon a time there was", []),
               (f"Hello {G} What is the capital of France?", [make_image(1)]),
               (f"{G} and {G} The quick brown fox", [make_image(2), make_image(3, 40, 60)]),
               (f"A picture: {G}", [make_image(4)])]
    check_with_logprobs(gemma3_vl_model, hf_gemma3_greedy, prompts, tp, pp, max_num_batched_tokens=24)
