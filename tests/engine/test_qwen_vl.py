"""Images in (Qwen2.5-VL, Qwen3-VL, Qwen2-VL and Qwen3.5 dense and MoE, each test once per family): the offline
engine's greedy tokens and logprobs equal transformers' Qwen2_5_VLForConditionalGeneration /
Qwen3VLForConditionalGeneration / Qwen2VLForConditionalGeneration / Qwen3_5ForConditionalGeneration /
Qwen3_5MoeForConditionalGeneration with the same image processor and weights: M-RoPE positions inside and after images
(interleaved for Qwen3-VL and Qwen3.5, partial for Qwen3.5), deepstack features (Qwen3-VL), the hybrid Gated DeltaNet
decoder (Qwen3.5), images of different sizes, an image in a later turn, batching with text-only requests, chunked
prefill across an image's tokens, preemption and prefix caching (Qwen3.5: its recurrent state kept per image)."""

from __future__ import annotations

import pytest

from imagekit import hf_qwen_vl_greedy, hf_qwen_vl_inputs, make_image, worst_logprob_diff
from shoal.engine import LLM, SamplingParams

pytest.importorskip("PIL")

MAX_NEW = 8
V = "<|vision_start|><|image_pad|><|vision_end|>"
ONE = f"Hello {V} What is the capital of France?"
TWO = f"{V} and {V} The quick brown fox"
LATER = (f"<|user|>Hello world!<|end|><|assistant|>How are you today?<|end|><|user|>Look: {V} What is this?<|end|>"
         "<|assistant|>")


class Family:
    """A tiny model of one family and its two image sizes: 2x2 merged patches (4 tokens) and 3x4 (12 tokens)."""

    def __init__(self, model, patch: int, hybrid: bool = False):
        self.model, self.side = model, 2 * patch
        self.hybrid = hybrid  # recurrent layers: a prefix hit needs the recurrent state kept at its end

    def small(self, seed: int):
        return make_image(seed, 2 * self.side, 2 * self.side)

    def large(self, seed: int):
        return make_image(seed, 4 * self.side, 3 * self.side)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "qwen2_vl", "qwen3_5_vl", "qwen3_5_moe_vl"])
def vl(request):
    model = {"qwen2_5_vl": "qwen_vl_model", "qwen3_vl": "qwen3_vl_model", "qwen2_vl": "qwen2_vl_model",
             "qwen3_5_vl": "qwen3_5_vl_model", "qwen3_5_moe_vl": "qwen3_5_moe_vl_model"}
    qwen3 = request.param.startswith("qwen3")  # Qwen3-VL's tower (patch 16)
    return Family(request.getfixturevalue(model[request.param]), 16 if qwen3 else 14,
                  hybrid=request.param.startswith("qwen3_5"))


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)


def run(llm: LLM, prompts: list[tuple[str, list]]):
    return llm.generate([{"prompt": text, "multi_modal_data": {"image": images}} for text, images in prompts],
                        greedy(), use_tqdm=False)


def check(model, outputs, prompts):
    """Tokens equal, and every logprob the engine reports within float32 noise of transformers' (a wrong height or
    width position moves them while the argmax of a tiny random model may hold)."""
    assert worst_logprob_diff(hf_qwen_vl_greedy, model, outputs, prompts, MAX_NEW) < 2e-4


@pytest.fixture(scope="module")
def llm(vl):
    engine = LLM(vl.model, dtype="float32", num_kv_blocks=128, block_size=4, max_model_len=128)
    yield engine
    engine.shutdown()


def test_positions_equal_transformers_get_rope_index(llm, vl):
    # two images of different grids, text between and after: the 3-D positions and the delta, exactly
    import transformers as tf

    images = [vl.large(1), vl.small(2)]
    placed = llm.llm_engine.images.place(llm.llm_engine.tokenizer.encode(TWO),
                                         llm.llm_engine.images.preprocess(images), 4)[1]
    inputs = hf_qwen_vl_inputs(vl.model, TWO, images)
    model = getattr(tf, tf.AutoConfig.from_pretrained(str(vl.model)).architectures[0]).from_pretrained(str(vl.model))
    want, delta = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                             image_grid_thw=inputs["image_grid_thw"])
    assert placed.positions.tolist() == want[:, 0].tolist()
    assert placed.rope_delta == int(delta) < 0


def test_one_image_and_two_of_different_sizes_match_transformers(llm, vl):
    prompts = [(ONE, [vl.small(1)]), (TWO, [vl.large(2), vl.small(3)])]
    check(vl.model, run(llm, prompts), prompts)


def test_an_image_in_a_later_turn(llm, vl):
    prompts = [(LATER, [vl.large(4)])]
    check(vl.model, run(llm, prompts), prompts)


def test_batched_with_a_text_only_request(llm, vl):
    # the text-only prompt keeps plain positions in the same steps as the image prompts' shifted ones; their decode
    # steps (plain positions + the rope delta) run through the captured decode graphs like any decoder's (a hybrid's
    # decode steps run eagerly: it has no decode graphs)
    graphs = llm.llm_engine.executor.runner.decode_graphs
    assert (graphs is None) == vl.hybrid
    before = graphs.num_padded_steps if graphs is not None else 0
    prompts = [(ONE, [vl.large(5)]), ("Once upon a time there was", []), (TWO, [vl.small(6), vl.small(7)])]
    check(vl.model, run(llm, prompts), prompts)
    if graphs is not None:
        assert graphs.num_padded_steps >= before + MAX_NEW - 1


def test_chunked_prefill_across_the_image_encodes_it_once(vl):
    # 5 tokens a step: the 12 image tokens are prefilled over 3-4 steps, each slicing the prompt's 3-D positions
    engine = LLM(vl.model, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=5, max_model_len=64,
                 block_size=4)
    try:
        prompts = [(ONE, [vl.large(8)])]
        check(vl.model, run(engine, prompts), prompts)
        assert engine.llm_engine.executor.runner.encoder_cache.encoded == 1
    finally:
        engine.shutdown()


def test_preempted_image_requests_are_recomputed_exactly(vl):
    # 3 prompts of 24 tokens (6 blocks) growing by 8 each in a pool of 14 blocks of 4: some are preempted and prefilled again
    # from position 0, generated tokens included (at their index + the rope delta)
    engine = LLM(vl.model, dtype="float32", num_kv_blocks=14, block_size=4, max_model_len=48,
                 enable_prefix_caching=False)
    try:
        prompts = [(ONE, [vl.small(30 + i)]) for i in range(3)]
        check(vl.model, run(engine, prompts), prompts)
        assert engine.llm_engine.scheduler.num_preemptions > 0
    finally:
        engine.shutdown()


def test_prefix_cache_hits_the_same_image_only(llm, vl):
    llm.reset_prefix_cache()
    image, other = vl.large(9), vl.large(10)
    first = run(llm, [(ONE, [image])])[0]
    again = run(llm, [(ONE, [image])])[0]
    assert first.num_cached_tokens == 0
    # every full block but the one holding the last prompt token (always computed) comes from the cache
    assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 4 * 4
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    check(vl.model, [again], [(ONE, [image])])
    # same text, another image of the same size: only the blocks before the image are shared (a hybrid keeps its
    # recurrent state at the prompt's last full block only, whose hash chain covers the image: nothing is shared)
    swapped = run(llm, [(ONE, [other])])[0]
    image_start = first.prompt_token_ids.index(llm.llm_engine.images.token_id)
    assert swapped.num_cached_tokens == (0 if vl.hybrid else image_start // 4 * 4) < again.num_cached_tokens
    check(vl.model, [swapped], [(ONE, [other])])


@pytest.mark.parametrize("count, prompt, message", [
    (5, V * 5, "more than the limit of 4"),
    (2, ONE, "1 image placeholder(s) '<|image_pad|>' for 2 image(s)"),
])
def test_bad_images_are_refused_and_hold_nothing(llm, vl, count, prompt, message):
    images = [vl.small(i) for i in range(count)]
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("|", r"\|")):
        engine.add_request("bad", prompt, greedy(), images=images)
    assert not engine.has_unfinished_requests() and "bad" not in engine.requests
    engine.pool.check_all_free()


def test_max_image_pixels_applies(vl):
    engine = LLM(vl.model, dtype="float32", num_kv_blocks=32, block_size=4, max_model_len=64,
                 max_image_pixels=4 * vl.side ** 2)  # the small image exactly
    try:
        with pytest.raises(ValueError, match=f"more than the budget of {4 * vl.side ** 2} pixels"):
            engine.llm_engine.add_request("big", ONE, greedy(), images=[vl.large(1)])
        assert not engine.llm_engine.has_unfinished_requests()
        check(vl.model, run(engine, [(ONE, [vl.small(2)])]), [(ONE, [vl.small(2)])])
    finally:
        engine.shutdown()


def test_qwen3_vl_refuses_pipeline_parallelism(vl):
    # its deepstack features enter the first decoder layers, fed by the first stage's tower only
    if "deepstack_visual_indexes" not in (vl.model / "config.json").read_text():
        pytest.skip("deepstack is Qwen3-VL's (Qwen3.5 has none)")
    with pytest.raises(ValueError, match="deepstack"):
        LLM(vl.model, dtype="float32", num_kv_blocks=16, max_model_len=64, pipeline_parallel_size=2)
