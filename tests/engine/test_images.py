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


def test_kv_events_announce_image_blocks_with_their_digests():
    # an image block is published with the digests its hash covers (vLLM's extra_keys), so a router recomputes
    # every hash of the run, the blocks after the image included; text blocks carry None, a text run nothing
    from shoal.engine.core.images import ProcessedImage, PromptImages
    from shoal.engine.core.kv_cache import BlockPool
    from shoal.engine.core.kv_events import wire_event
    from shoal.engine.kv_hash import block_hash, extra_from_event, hash_chain

    def stored(digest: bytes):
        pool = BlockPool(16, 4, events=True)
        images = PromptImages([(4, ProcessedImage(None, 6, digest))], 4)  # tokens 4..9: blocks 1 and 2
        ids, hashes = pool.allocate(5), []
        pool.cache_full_blocks(tokens, ids, hashes, len(tokens), None, images.block_key)
        events = [e for e in pool.take_events() if e[0] == "BlockStored"]
        assert len(events) == 1 and events[0][1] == hashes  # one run: the image no longer splits it
        return wire_event(events[0], 4, "GPU", {})

    tokens = list(range(4)) + [7] * 6 + list(range(20, 30))
    event = stored(b"\x01" * 32)
    hashes, parent, tokens_sent, keys = event[1], event[2], event[3], event[8]
    assert parent is None and tokens_sent == tokens
    assert keys == [None, ["01" * 32], ["01" * 32], None, None]
    recomputed, h = [], 0
    for i, k in enumerate(keys):  # what a router does with the event alone
        h = block_hash(h, tokens_sent[4 * i:4 * i + 4], extra_from_event(k))
        recomputed.append(h)
    assert recomputed == hashes
    text = list(hash_chain(tokens, 4))
    assert hashes[0] == text[0] and hashes[1] != text[1] and hashes[3] != text[3]  # after the image: its chain
    other = stored(b"\x02" * 32)
    assert other[1][0] == hashes[0] and other[1][1:] != hashes[1:] and not set(other[1][1:]) & set(hashes)
    assert other[8][1] == ["02" * 32]

    # a text-only run is published exactly as before: eight fields, no extra_keys
    pool = BlockPool(16, 4, events=True)
    ids, chain = pool.allocate(2), []
    later = PromptImages([(20, ProcessedImage(None, 2, b"\x03" * 32))], 4)  # an image after these blocks
    pool.cache_full_blocks(list(range(8)), ids, chain, 8, None, later.block_key)
    (plain,) = pool.take_events()
    assert wire_event(plain, 4, "GPU", {}) == ["BlockStored", chain, None, list(range(8)), 4, None, "GPU", None]
    assert chain == list(hash_chain(list(range(8)), 4))


def test_an_image_prompts_events_from_the_engine_carry_its_digests(llava_model):
    # the real engine over ZMQ: its BlockStored for a prompt with an image carries the image's digest on the
    # blocks holding its tokens, and kv_hash with those extra keys recomputes every hash it published
    from shoal.engine.kv_hash import block_hash, extra_from_event
    from test_kv_events import Subscriber, free_port

    port = free_port()
    engine = LLM(llava_model, dtype="float32", num_kv_blocks=128, block_size=4,
                 kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                   "endpoint": f"tcp://*:{port}", "topic": "kv@img"})
    sub = Subscriber(port, b"kv@img")
    try:
        for i in range(100):  # a PUB socket drops what it sends before the subscription reaches it; each probe a
            engine.generate([[5 + i % 50] * 4], greedy(1), use_tqdm=False)  # new block (a cached one sends nothing)
            sub.drain(0.2)
            if sub.batches:
                break
        assert sub.batches, "no KV event reached the subscriber"
        assert engine.reset_prefix_cache()
        sub.drain(2)
        sub.batches.clear()
        image = make_image(11)
        run(engine, [(ONE, [image])])
        sub.drain(5)
    finally:
        sub.ctx.destroy(linger=0)
        engine.shutdown()
    stored = [e for e in sub.events() if e[0] == "BlockStored"]
    assert stored
    digest = engine.llm_engine.images.preprocess([image])[0].digest.hex()
    image_token = engine.llm_engine.images.token_id
    own, parent, seen_image = {}, 0, False
    for e in stored:
        hashes, prev, tokens, keys = e[1], e[2], e[3], (e[8] if len(e) > 8 else None)
        h = 0 if prev is None else own[prev]
        for i, reported in enumerate(hashes):
            block = tokens[4 * i:4 * i + 4]
            k = keys[i] if keys else None
            assert (k == [digest]) == (image_token in block), (block, k)
            seen_image |= k is not None
            h = block_hash(h, block, extra_from_event(k))
            assert h == reported
            own[reported] = h
        parent = h
    assert seen_image and parent
