"""Images under tensor and pipeline parallelism (gloo, worker processes on this machine): a step's image slices
travel to every rank with its plan, each rank runs the (replicated) vision tower for the images its embedding
needs, and pipeline micro-batches carry the slices of their own sequences (and Qwen-VL's 3-D positions). Greedy
output equals transformers' LLaVA, Qwen-VL and Qwen3.5, chunked prefill across the image's tokens included."""

from __future__ import annotations

import pytest

from imagekit import hf_llava_greedy, hf_qwen_vl_greedy, make_image
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
    with LLM(model, dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp,
             distributed={"micro_batches": 3}, num_kv_blocks=96, block_size=4, max_model_len=96,
             max_num_batched_tokens=10) as llm:
        outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in prompts],
                            SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3),
                            use_tqdm=False)
        for out, (text, images) in zip(outs, prompts):
            prompt, ids, logprobs = hf_qwen_vl_greedy(model, text, images, MAX_NEW)
            assert out.prompt_token_ids == prompt, text
            assert out.outputs[0].token_ids == ids, text
            for step, entry in enumerate(out.outputs[0].logprobs):
                for tid, lp in entry.items():
                    assert lp.logprob == pytest.approx(float(logprobs[step, tid]), abs=2e-4), (text, step)
        llm.llm_engine.pool.check_all_free()
