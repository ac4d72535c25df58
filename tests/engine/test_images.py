"""Images in (LLaVA): the offline engine's greedy output equals transformers' LlavaForConditionalGeneration with the
same processor and weights, across batching, chunked prefill inside an image's tokens and prefix caching; bad
images are refused and hold nothing."""

from __future__ import annotations

import pytest

from imagekit import encode, hf_llava_greedy, make_image
from shoal.engine import LLM, SamplingParams

pytest.importorskip("PIL")

MAX_NEW = 8
ONE = "Hello <image> What is the capital of France?"
TWO = "<image> and <image> The quick brown fox"


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run(llm: LLM, prompts: list[tuple[str, list]]):
    return llm.generate([{"prompt": text, "multi_modal_data": {"image": images}} for text, images in prompts],
                        greedy(), use_tqdm=False)


def check(llava_model, outputs, prompts):
    for out, (text, images) in zip(outputs, prompts):
        prompt, ids = hf_llava_greedy(llava_model, text, images, MAX_NEW)
        assert out.prompt_token_ids == prompt, text
        assert out.outputs[0].token_ids == ids, text


@pytest.fixture(scope="module")
def llm(llava_model):
    engine = LLM(llava_model, dtype="float32", num_kv_blocks=128, block_size=4)
    yield engine
    engine.shutdown()


def test_one_and_two_images_match_transformers(llm, llava_model):
    prompts = [(ONE, [make_image(1)]), (TWO, [make_image(2), make_image(3, 30, 70)])]
    check(llava_model, run(llm, prompts), prompts)


def test_a_siglip_tower_matches_transformers(tmp_path_factory):
    from shoal.engine.tools.tiny_model import make_llava_model

    model = make_llava_model(tmp_path_factory.mktemp("llava-siglip"), vision="siglip", seed=3)
    engine = LLM(model, dtype="float32", num_kv_blocks=64, max_model_len=64, block_size=4)
    try:
        prompts = [(ONE, [make_image(14)]), (TWO, [make_image(15), make_image(16)])]
        check(model, run(engine, prompts), prompts)
    finally:
        engine.shutdown()


def test_image_batched_with_text_only(llm, llava_model):
    prompts = [(ONE, [make_image(4)]), ("Once upon a time there was", [])]
    check(llava_model, run(llm, prompts), prompts)


def test_chunked_prefill_inside_the_image_encodes_it_once(llava_model):
    # 6 tokens a step: the 16 image tokens are prefilled over 3-4 steps; the features come from one encoder run
    engine = LLM(llava_model, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=6, max_model_len=64,
                 block_size=4)
    try:
        prompts = [(ONE, [make_image(5)])]
        check(llava_model, run(engine, prompts), prompts)
        assert engine.llm_engine.executor.runner.encoder_cache.encoded == 1
    finally:
        engine.shutdown()


def test_a_later_prompt_about_the_same_image_reuses_its_encoder_output(llm, llava_model):
    # different text before the image: no KV block is shared, the image's tokens are prefilled again from the
    # features the encoder cache kept
    cache = llm.llm_engine.executor.runner.encoder_cache
    before = cache.encoded
    image = make_image(10)
    prompts = [("Hello <image> Paris", [image])]
    check(llava_model, run(llm, prompts), prompts)
    prompts = [("Once upon a time <image> Paris", [image])]
    check(llava_model, run(llm, prompts), prompts)
    assert cache.encoded == before + 1


def test_preempted_image_requests_are_recomputed_exactly(llava_model):
    # 3 prompts of ~28 tokens growing by 8 each, in a pool of 20 blocks of 4: some are preempted mid-way and
    # prefilled again from position 0, image features included
    engine = LLM(llava_model, dtype="float32", num_kv_blocks=20, block_size=4, max_model_len=64,
                 enable_prefix_caching=False)
    try:
        prompts = [(ONE, [make_image(30 + i)]) for i in range(3)]
        check(llava_model, run(engine, prompts), prompts)
        assert engine.llm_engine.scheduler.num_preemptions > 0
    finally:
        engine.shutdown()


def test_prefix_cache_sees_the_image(llm, llava_model):
    llm.reset_prefix_cache()
    image, other = make_image(6), make_image(7)
    first = run(llm, [(ONE, [image])])[0]
    again = run(llm, [(ONE, [image])])[0]
    assert first.num_cached_tokens == 0
    # every full block but the one holding the last prompt token (always computed) comes from the cache
    assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 4 * 4
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # same text, another image: only the text blocks before the image are shared ("Hello " is one block of 4)
    swapped = run(llm, [(ONE, [other])])[0]
    image_start = first.prompt_token_ids.index(llm.llm_engine.images.token_id)
    assert swapped.num_cached_tokens == image_start // 4 * 4 < again.num_cached_tokens
    check(llava_model, [swapped], [(ONE, [other])])


@pytest.mark.parametrize("images, prompt, message", [
    ([b"not an image at all"], ONE, "not one of the supported formats"),
    ([encode(make_image(8))[:200]], ONE, "corrupt or truncated"),
    ([encode(make_image(8), "TIFF")], ONE, "not one of the supported formats"),
    ([make_image(i) for i in range(5)], "<image>" * 5, "more than the limit of 4"),
    ([make_image(8), make_image(9)], ONE, "1 image placeholder(s) '<image>' for 2 image(s)"),
    ([], ONE, "1 image placeholder(s) '<image>' for 0 image(s)"),
])
def test_bad_images_are_refused_and_hold_nothing(llm, images, prompt, message):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        engine.add_request("bad", prompt, greedy(), images=images)
    assert not engine.has_unfinished_requests() and "bad" not in engine.requests
    engine.pool.check_all_free()


def test_text_only_model_refuses_images(llama_model):
    engine = LLM(llama_model, dtype="float32", num_kv_blocks=16, max_model_len=64)
    try:
        with pytest.raises(ValueError, match="takes text only"):
            engine.llm_engine.add_request("x", "Hello", greedy(), images=[make_image(0)])
        assert not engine.llm_engine.has_unfinished_requests()
    finally:
        engine.shutdown()


def test_kv_events_leave_out_the_blocks_holding_an_image():
    # a router rebuilds block hashes from the published tokens: an image block published would be indexed as the
    # text-only prefix's (and flip the gateway's "this engine hashes like me" check), so only text blocks are told
    from shoal.engine.core.images import ProcessedImage, PromptImages
    from shoal.engine.core.kv_cache import BlockPool
    from shoal.engine.kv_hash import hash_chain

    pool = BlockPool(16, 4, events=True)
    image = ProcessedImage(None, 6, b"\x01" * 32)
    images = PromptImages([(4, image)], 4)  # tokens 4..9: blocks 1 and 2
    tokens = list(range(4)) + [7] * 6 + list(range(20, 30))
    ids, hashes = pool.allocate(5), []
    pool.cache_full_blocks(tokens, ids, hashes, len(tokens), None, images.block_key)
    stored = [e for e in pool.take_events() if e[0] == "BlockStored"]
    assert [e[1] for e in stored] == [hashes[:1], hashes[3:]]
    assert hashes[0] == next(hash_chain(tokens, 4))  # a text block before the image hashes as always
    assert hashes[1] != list(hash_chain(tokens, 4))[1]  # an image block covers the image
