"""The engine against transformers: same greedy tokens, same logits, under every scheduling regime."""

from __future__ import annotations

import contextlib
import json
import logging
import random

import pytest
import torch

from hf_reference import hf_greedy
from shoal.engine import LLM, SamplingParams

pytestmark = pytest.mark.numerics

PROMPTS = [
    "Hello world! The quick brown",
    "Once upon a time there was a little shoal of fish that swam together in the warm",
    "def add(a, b):",
    "Kubernetes runs pods on nodes; an operator reconciles custom resources into deployments",
    "A",
    "numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and punctuation",
]
MAX_NEW = 12

# Each scheduling regime the engine must get right. block_size 4 keeps blocks small so that tiny prompts still
# span several of them.
REGIMES = {
    "batched": dict(block_size=4, max_model_len=128),
    "chunked-prefill": dict(block_size=4, max_model_len=128, max_num_batched_tokens=8),
    "preemption": dict(block_size=4, max_model_len=64, num_kv_blocks=16, max_num_batched_tokens=16),
    "no-prefix-cache": dict(block_size=8, max_model_len=128, enable_prefix_caching=False),
    # auto picks the C++ paged kernel on CPU; the SDPA backend (gathered blocks) must agree too.
    "sdpa-chunked": dict(block_size=4, max_model_len=128, max_num_batched_tokens=8, attention_backend="sdpa"),
    # Decode steps padded into batch-size buckets and run from static buffers (graph_capture.py). Every regime
    # above replays recorded CPU decode graphs (the CPU default) and sends small batches' matmuls to the small-M
    # kernel (layers/small_gemm.py); "eager" pads without a graph; "latency-paths-off" runs each decode step
    # through the Python model as it is, every matmul through torch.
    "decode-capture": dict(block_size=4, max_model_len=128, decode_capture="eager"),
    "latency-paths-off": dict(block_size=4, max_model_len=128, decode_capture="none"),
}


def check_against_hf(model_dir, tokenizer, outputs, prompts, max_new=MAX_NEW, logprob_tol=2e-4):
    for prompt, out in zip(prompts, outputs):
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        ref_ids, ref_lp = hf_greedy(model_dir, ids, max_new)
        got = out.outputs[0]
        assert got.token_ids == ref_ids, f"prompt {prompt!r}: {got.token_ids} != transformers {ref_ids}"
        assert got.finish_reason == "length"
        if got.logprobs is not None:
            for step, entry in enumerate(got.logprobs):
                for tid, lp in entry.items():
                    assert lp.logprob == pytest.approx(float(ref_lp[step, tid]), abs=logprob_tol), (prompt, step, tid)


def family_fixture(archs: list[str]):
    """For a family's test module: a module-scoped `family` fixture, each of `archs` in turn as (arch, tiny model
    directory)."""

    @pytest.fixture(scope="module", params=archs)
    def family(request, model_factory):
        return request.param, model_factory(request.param)

    return family


@contextlib.contextmanager
def family_engine(model_dir, architecture: str, **engine_kw):
    """The engine on a family's tiny model, checked to be that family's: its config.json names `architecture` and
    the engine built the model class of that name."""
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == [architecture]
    with LLM(model=model_dir, **engine_kw) as llm:
        assert type(llm.llm_engine.executor.runner.model).__name__ == architecture
        yield llm


SHARED_PREFIX = "Kubernetes runs pods on nodes; an operator reconciles custom resources into deployments and services."


def prefix_sharing_runs(llm, *more_tails: str):
    """Prompts sharing a long prefix, the first run alone, then the rest (greedy, top-3 logprobs): the rest are
    prefix-cache hits. Returns (prompts, params, first outputs, rest outputs)."""
    prompts = [SHARED_PREFIX + tail for tail in (" Hello", " Once upon a time", " def add(a, b):", *more_tails)]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    first = llm.generate(prompts[:1], params)
    rest = llm.generate(prompts[1:], params)
    assert llm.llm_engine.pool.prefix_hits > 0
    return prompts, params, first, rest


def check_mode_against_hf(llm, model_dir, mode: str) -> None:
    """For the families' mode tests: greedy tokens and top-5 logprobs equal transformers', a mode named for a
    mechanism exercised it (preemptions in "chunked-preemption", padded decode steps in "decode-capture"), and every
    block is free afterwards."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    outputs = llm.generate(PROMPTS, params)
    check_against_hf(model_dir, llm.get_tokenizer(), outputs, PROMPTS)
    if mode == "chunked-preemption":
        assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for the batch"
    if mode == "decode-capture":
        assert engine.executor.runner.decode_graphs.num_padded_steps > 0
    engine.pool.check_all_free()


@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_matches_transformers(any_model, regime, monkeypatch):
    arch, model_dir = any_model
    if regime == "latency-paths-off":
        from shoal.engine.execution.layers import small_gemm

        monkeypatch.setattr(small_gemm, "MAX_ROWS", 0)
    with LLM(model=model_dir, **REGIMES[regime]) as llm:
        assert llm.llm_engine.executor.backend_name == REGIMES[regime].get("attention_backend", "cpu")
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
        outputs = llm.generate(PROMPTS, params)
        check_against_hf(model_dir, llm.get_tokenizer(), outputs, PROMPTS)
        engine = llm.llm_engine
        graphs = engine.executor.runner.decode_graphs
        if regime in ("latency-paths-off", "sdpa-chunked"):  # SDPA plans on the host: never captured
            assert graphs is None
        else:
            assert graphs.num_padded_steps > 0
            assert regime == "decode-capture" or (graphs.graphs and not graphs.failed), "no CPU graph was captured"
        if regime == "preemption":
            assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for the batch"
        engine.pool.check_all_free()


# phi3: every layer windowed, so the first request's leading blocks were freed as it advanced (keeping their
# hashes); the later requests must still find them as a cached prefix and get the same tokens.
@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_prefix_caching_reuses_blocks_and_matches(model_factory, arch):
    model_dir = model_factory(arch)
    with LLM(model=model_dir, block_size=4, max_model_len=128) as llm:
        prompts, params, first, rest = prefix_sharing_runs(llm, " numbers 0 1 2")
        engine = llm.llm_engine
        shared = len(llm.get_tokenizer().encode(SHARED_PREFIX))
        assert all(o.num_cached_tokens >= 4 * (shared // 4 - 1) for o in rest)
        check_against_hf(model_dir, llm.get_tokenizer(), first + rest, prompts)
        # The same prompt again is served almost entirely from the cache and still matches.
        again = llm.generate(prompts[:1], params)
        assert again[0].num_cached_tokens > 0
        assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
        engine.pool.check_all_free()


def test_requests_arriving_while_others_decode(any_model):
    arch, model_dir = any_model
    with LLM(model=model_dir, block_size=4, max_model_len=128, max_num_batched_tokens=12) as llm:
        engine = llm.llm_engine
        tok = llm.get_tokenizer()
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
        pending = list(enumerate(PROMPTS))
        finished = {}
        step = 0
        while pending or engine.has_unfinished_requests():
            if pending and step % 3 == 0:  # a new request every third step, mid-decode of the others
                i, p = pending.pop(0)
                engine.add_request(str(i), p, params)
            for out in engine.step():
                if out.finished:
                    finished[int(out.request_id)] = out
            step += 1
        check_against_hf(model_dir, tok, [finished[i] for i in range(len(PROMPTS))], PROMPTS)
        engine.pool.check_all_free()


def test_sharded_checkpoint_loads_tensor_by_tensor(model_factory):
    model_dir = model_factory("llama", max_shard_size="40KB")
    assert len(list(model_dir.glob("*.safetensors"))) > 2 and (model_dir / "model.safetensors.index.json").exists()
    with LLM(model=model_dir, block_size=4, max_model_len=64) as llm:
        outputs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        check_against_hf(model_dir, llm.get_tokenizer(), outputs, PROMPTS[:2], max_new=6)


def test_token_id_prompts_and_order(llama_model):
    with LLM(model=llama_model, block_size=4, max_model_len=64) as llm:
        tok = llm.get_tokenizer()
        prompts = [{"prompt_token_ids": tok.encode(p)} for p in PROMPTS[:3]]
        outputs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 7, 5)])
        assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 7, 5]
        assert outputs[1].prompt_token_ids == prompts[1]["prompt_token_ids"]


def test_random_aborts_return_every_block(llama_model):
    """Requests arrive, get preempted, finish or are aborted at random: the pool ends with every block free."""
    rng = random.Random(7)
    with LLM(model=llama_model, block_size=4, max_model_len=48, num_kv_blocks=20, max_num_batched_tokens=16,
             max_num_seqs=6) as llm:
        engine = llm.llm_engine
        vocab = engine.vocab_size
        live: set[str] = set()
        for step in range(300):
            if rng.random() < 0.4 and len(live) < 12:
                rid = f"r{step}"
                prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 24))]
                engine.add_request(rid, prompt, SamplingParams(temperature=rng.choice([0, 1.0]), n=rng.choice([1, 2]),
                                                              max_tokens=rng.randint(1, 20), ignore_eos=True))
                live.add(rid)
            if live and rng.random() < 0.15:
                victim = rng.choice(sorted(live))
                engine.abort_request(victim)
                live.discard(victim)
            for out in engine.step():
                if out.finished:
                    live.discard(out.request_id)
            # Every referenced block is held by exactly as many live sequences as its ref count says.
            held: dict[int, int] = {}
            for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
                for b in seq.block_ids:
                    held[b] = held.get(b, 0) + 1
            assert {b.block_id: b.ref_count for b in engine.pool.blocks if b.ref_count} == held
        engine.abort_request(sorted(live))
        assert not engine.has_unfinished_requests()
        engine.pool.check_all_free()
        assert engine.scheduler.num_preemptions > 0


def test_priority_policy_preempts_lowest_priority(llama_model):
    with LLM(model=llama_model, block_size=4, max_model_len=40, num_kv_blocks=12, max_num_batched_tokens=64,
             scheduling_policy="priority") as llm:
        engine = llm.llm_engine
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        engine.add_request("low", [5] * 10, params, priority=10)
        engine.step()
        engine.add_request("high", [6] * 10, params, priority=0)
        order = []
        while engine.has_unfinished_requests():
            order += [o.request_id for o in engine.step() if o.finished]
        assert order[0] == "high"
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("arch", ["llama", "bloom", "gemma2", "phi3", "gpt_oss"])
def test_triton_backend_matches_transformers(model_factory, arch):
    """The Triton paged kernel (run by Triton's interpreter on CPU) drives the whole engine to the same tokens."""
    from shoal.engine.execution.attention import backend_class

    ok, why = backend_class("triton").is_available(torch.device("cpu"))
    if not ok:
        pytest.skip(why)
    model_dir = model_factory(arch)
    with LLM(model=model_dir, block_size=4, max_model_len=64, max_num_batched_tokens=8,
             attention_backend="triton") as llm:
        assert llm.llm_engine.executor.backend_name == "triton"
        prompts = PROMPTS[:3]
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2))
        check_against_hf(model_dir, llm.get_tokenizer(), outputs, prompts, max_new=4)


def test_flash_backend_is_refused_for_alibi(model_factory):
    with pytest.raises(ValueError, match="ALiBi"):
        LLM(model=model_factory("bloom"), max_model_len=64, attention_backend="flash")


def test_bfloat16_engine_tracks_transformers(model_factory):
    """bf16 (with oneDNN-prepacked weights on CPU) stays within bf16 rounding of transformers in bf16."""
    model_dir = model_factory("llama")
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    with LLM(model=model_dir, dtype="bfloat16", block_size=4, max_model_len=64) as llm:
        tok = llm.get_tokenizer()
        outputs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1))
        for prompt, out in zip(PROMPTS[:3], outputs):
            ids = tok.encode(prompt)
            with torch.no_grad():
                logits = ref(torch.tensor([ids + out.outputs[0].token_ids])).logits[0].float()
            ref_lp = torch.log_softmax(logits[len(ids) - 1:-1], dim=-1)
            for step, (tid, entry) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
                assert entry[tid].logprob == pytest.approx(float(ref_lp[step, tid]), abs=0.1)
                assert float(ref_lp[step, tid]) >= float(ref_lp[step].max()) - 0.1  # greedy pick is (near) the top


def test_all_windowed_layers_free_slid_out_blocks_and_match_transformers(model_factory, caplog):
    """Phi-3 tiny: every layer sees the last 10 tokens. Six sequences of up to 71 tokens (about 300 in all) run in
    a 20-block (80-token) cache because each holds only the blocks its window still covers."""
    model_dir = model_factory("phi3")
    with caplog.at_level(logging.INFO, logger="shoal.engine.core.engine"), \
            LLM(model=model_dir, block_size=4, max_model_len=80, num_kv_blocks=20, max_num_batched_tokens=16) as llm:
        engine = llm.llm_engine
        assert engine.kv_window == 10
        assert "freed, so a decoding sequence holds at most 4 blocks instead of 20" in caplog.text
        tok = llm.get_tokenizer()
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, params)
        finished, freed = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[int(out.request_id)] = out
            for seq in engine.scheduler.running:  # after a step: the window's blocks, and nothing older
                assert len(seq.held_block_ids) <= (10 - 1) // 4 + 2
                freed = max(freed, seq.num_freed_blocks)
        assert freed >= 8
        check_against_hf(model_dir, tok, [finished[i] for i in range(len(PROMPTS))], PROMPTS, max_new=30)
        engine.pool.check_all_free()


def test_interleaved_windows_keep_every_block(model_factory, caplog):
    with caplog.at_level(logging.INFO, logger="shoal.engine.core.engine"), \
            LLM(model=model_factory("gemma2"), block_size=4, max_model_len=64) as llm:
        assert llm.llm_engine.kv_window is None
        assert "on 2 of 4 layers: the 2 global layers need every block, so no KV blocks are freed" in caplog.text


def test_longrope_long_factors_past_the_original_context(model_factory):
    """A server whose max_model_len exceeds original_max_position_embeddings rotates with LongRoPE's long factors
    (and its attention factor); transformers does the same for sequences already past that length."""
    model_dir = model_factory("phi3", original_max_position_embeddings=16, max_position_embeddings=256)
    with LLM(model=model_dir, block_size=4, max_model_len=96) as llm:
        tok = llm.get_tokenizer()
        prompts = [p for p in PROMPTS if len(tok.encode(p)) > 16]
        assert prompts
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3))
        check_against_hf(model_dir, tok, outputs, prompts, max_new=8)

