"""Images in Gemma 3 (Gemma3ForConditionalGeneration): the offline engine's prompt ids, greedy tokens and logprobs
equal transformers' with the same Gemma3Processor and weights: bidirectional attention within each image (shown to
matter), sliding and global layers, two images, an image in a later turn, batching with a text-only request, chunked
prefill that keeps every image whole, and prefix caching. Tensor and pipeline parallelism:
tests/parallel/test_images_parallel.py."""

from __future__ import annotations

import pytest

from imagekit import hf_gemma3_greedy, make_image, worst_logprob_diff
from shoal.engine import LLM, SamplingParams

pytest.importorskip("PIL")

MAX_NEW = 6
B = "<start_of_image>"
ONE = f"Hello {B} What is the capital of France?"
TWO = f"{B} and {B} The quick brown fox"
LATER = (f"<|user|>Hello world!<|end|><|assistant|>How are you today?<|end|><|user|>Look: {B} What is this?<|end|>"
         "<|assistant|>")
IMAGE_TOKENS = 16


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)


def run(llm: LLM, prompts: list[tuple[str, list]]):
    return llm.generate([{"prompt": text, "multi_modal_data": {"image": images}} for text, images in prompts],
                        greedy(), use_tqdm=False)


def worst(model, outputs, prompts) -> float:
    """The largest logprob difference from transformers' (after checking prompt ids and tokens are equal)."""
    return worst_logprob_diff(hf_gemma3_greedy, model, outputs, prompts, MAX_NEW)


def check(model, outputs, prompts):
    assert worst(model, outputs, prompts) < 2e-4


@pytest.fixture(scope="module")
def llm(gemma3_vl_model):
    engine = LLM(gemma3_vl_model, dtype="float32", num_kv_blocks=160, block_size=4, max_model_len=128)
    yield engine
    engine.shutdown()


def test_one_image_and_two_match_transformers(llm, gemma3_vl_model):
    prompts = [(ONE, [make_image(1)]), (TWO, [make_image(2), make_image(3, 40, 60)])]
    outs = run(llm, prompts)
    check(gemma3_vl_model, outs, prompts)
    # the placeholder became "\n\n" <start_of_image>, 16 image tokens, <end_of_image> "\n\n" (Gemma3Processor's)
    images = llm.llm_engine.images
    assert outs[0].prompt_token_ids.count(images.image_token_id) == IMAGE_TOKENS
    assert outs[1].prompt_token_ids.count(images.image_token_id) == 2 * IMAGE_TOKENS


def test_an_image_in_a_later_turn(llm, gemma3_vl_model):
    prompts = [(LATER, [make_image(4)])]
    check(gemma3_vl_model, run(llm, prompts), prompts)


def test_batched_with_a_text_only_request(llm, gemma3_vl_model):
    # only steps prefilling image tokens carry spans (the masked path); decode steps run the captured graphs
    runner = llm.llm_engine.executor.runner
    graphs, execute, steps = runner.decode_graphs, runner.execute, []

    def spy(inputs, hidden=None):
        steps.append((inputs.image_spans, inputs.images is not None, max(inputs.query_lens) == 1))
        return execute(inputs, hidden)

    before = graphs.num_padded_steps
    runner.execute = spy
    try:
        prompts = [(ONE, [make_image(5)]), ("Once upon a time there was", []), (TWO, [make_image(6), make_image(7)])]
        check(gemma3_vl_model, run(llm, prompts), prompts)
    finally:
        del runner.execute
    assert graphs.num_padded_steps >= before + MAX_NEW - 1
    assert any(spans for spans, _, _ in steps)
    assert all(images for spans, images, _ in steps if spans)
    assert not any(spans for spans, _, decode in steps if decode)


def test_preempted_image_requests_are_recomputed_exactly(gemma3_vl_model):
    # 3 prompts of 40 tokens in a pool of 30 blocks of 4: some are preempted and prefilled again, images whole
    engine = LLM(gemma3_vl_model, dtype="float32", num_kv_blocks=30, block_size=4, max_model_len=64,
                 enable_prefix_caching=False)
    try:
        prompts = [(ONE, [make_image(30 + i)]) for i in range(3)]
        check(gemma3_vl_model, run(engine, prompts), prompts)
        assert engine.llm_engine.scheduler.num_preemptions > 0
    finally:
        engine.shutdown()


def test_a_prefix_hit_ending_inside_an_image_is_exact(gemma3_vl_model):
    # a text request evicts the tail of the image prompt's cached blocks: the repeated prompt's hit ends inside the
    # image, and its chunk prefills the image's rest (seeing the cached first part, as the whole image attends)
    engine = LLM(gemma3_vl_model, dtype="float32", num_kv_blocks=14, block_size=4, max_model_len=56)
    try:
        prompt = (ONE, [make_image(3)])
        first = run(engine, [prompt])[0]
        run(engine, [("Once upon a time there was a little fox who lived in the woods", [])])
        again = run(engine, [prompt])[0]
        start = first.prompt_token_ids.index(engine.llm_engine.images.image_token_id)
        assert start < again.num_cached_tokens < start + IMAGE_TOKENS
        check(gemma3_vl_model, [again], [prompt])
    finally:
        engine.shutdown()


def test_bidirectional_image_attention_matters(gemma3_vl_model):
    # the same engine with causal-only image attention moves the logprobs well past float32 noise
    engine = LLM(gemma3_vl_model, dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=128,
                 enable_prefix_caching=False)
    try:
        prompts = [(ONE, [make_image(8)])]
        assert worst(gemma3_vl_model, run(engine, prompts), prompts) < 2e-4
        engine.llm_engine.images.bidirectional = False
        outs = run(engine, prompts)
        lp = hf_gemma3_greedy(gemma3_vl_model, ONE, prompts[0][1], MAX_NEW)[2]
        first = outs[0].outputs[0].logprobs[0]
        assert max(abs(v.logprob - float(lp[0, t])) for t, v in first.items()) > 1e-3
    finally:
        engine.shutdown()


def test_chunked_prefill_keeps_each_image_whole(gemma3_vl_model):
    # 20 tokens a step: more than one image (16) but less than the prompt; no chunk may end inside an image
    engine = LLM(gemma3_vl_model, dtype="float32", num_kv_blocks=96, max_num_batched_tokens=20, max_model_len=128,
                 block_size=4)
    sched = engine.llm_engine.scheduler
    chunks = []
    schedule = sched.schedule

    def spy():
        out = schedule()
        chunks.extend((s.seq, s.seq.num_computed_tokens, s.num_new_tokens) for s in out.scheduled)
        return out

    sched.schedule = spy
    try:
        prompts = [(TWO, [make_image(9), make_image(10)]), (ONE, [make_image(11)])]
        outs = run(engine, prompts)
        check(gemma3_vl_model, outs, prompts)
        assert max(len(o.prompt_token_ids) for o in outs) > 20
        prefills = [(seq, c, n) for seq, c, n in chunks if n > 1]
        assert len({id(seq) for seq, _, _ in prefills}) == 2 and len(prefills) > 2  # chunked
        for seq, c, n in prefills:
            for offset, image in seq.images.placed:
                assert not offset < c + n < offset + image.num_tokens, (c, n, offset)
        assert engine.llm_engine.executor.runner.encoder_cache.encoded == 3
    finally:
        engine.shutdown()


def test_a_chunk_never_ends_inside_an_image(llm):
    # a chunk stops before an image it cannot hold, and one starting inside an image (after a prefix-cache hit
    # there) takes its whole rest or nothing
    engine = llm.llm_engine
    ids = engine.tokenizer.encode(ONE)
    _, placed = engine.images.place(ids, engine.images.preprocess([make_image(12)]), 4)
    (offset, image), = placed.placed
    end = offset + image.num_tokens
    assert placed.cut(0, offset + 3) == offset
    assert placed.cut(0, end) == end and placed.cut(0, end + 5) == end + 5
    assert placed.cut(offset + 4, image.num_tokens - 5) == 0
    assert placed.cut(offset + 4, image.num_tokens - 4) == image.num_tokens - 4
    assert placed.spans(offset + 4, end + 2) == [(offset, end)] and placed.spans(0, offset) == []


def test_max_num_batched_tokens_below_one_image_is_refused(gemma3_vl_model):
    with pytest.raises(ValueError, match=r"--max-num-batched-tokens \(8\) is smaller than one image's 16 tokens"):
        LLM(gemma3_vl_model, dtype="float32", num_kv_blocks=32, max_num_batched_tokens=8, max_model_len=64,
            block_size=4)


def test_prefix_cache_hits_the_same_image_only(llm, gemma3_vl_model):
    llm.reset_prefix_cache()
    image, other = make_image(13), make_image(14)
    first = run(llm, [(ONE, [image])])[0]
    again = run(llm, [(ONE, [image])])[0]
    assert first.num_cached_tokens == 0
    # every full block but the one holding the last prompt token (always computed), the image's blocks included
    assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 4 * 4
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    check(gemma3_vl_model, [again], [(ONE, [image])])
    # same text, another image: only the blocks before the image are shared
    swapped = run(llm, [(ONE, [other])])[0]
    image_start = first.prompt_token_ids.index(llm.llm_engine.images.image_token_id)
    assert swapped.num_cached_tokens == image_start // 4 * 4 < again.num_cached_tokens
    check(gemma3_vl_model, [swapped], [(ONE, [other])])


def test_bad_images_are_refused(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=r"1 image placeholder\(s\) '<start_of_image>' for 2 image\(s\)"):
        engine.add_request("bad", ONE, greedy(), images=[make_image(1), make_image(2)])
    assert not engine.has_unfinished_requests()
