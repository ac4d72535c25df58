"""Multi-LoRA serving: a batch mixing the base model and adapters of different ranks equals, per request,
transformers on a checkpoint with that adapter merged, in every scheduling regime; bad adapters are refused with a
clear error and leave the engine serving; LRU residency; loading and unloading while requests run."""

from __future__ import annotations

import pytest
import torch

from hf_reference import hf_greedy
from lora_reference import merged_model
from shoal.engine import LLM, SamplingParams
from shoal.engine.core.lora import LoRACapacityError, LoRANotFoundError
from shoal.engine.execution.lora import LoRAError, lora_apply_, lora_apply_reference
from shoal.engine.tools.tiny_lora import ATTN, MLP, make_lora_adapter

pytestmark = pytest.mark.numerics

PROMPTS = [
    "Hello world! The quick brown",
    "Once upon a time there was a little shoal of fish that swam together in the warm",
    "def add(a, b):",
]
MAX_NEW = 8
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
LORA = dict(enable_lora=True, max_loras=3, max_lora_rank=16)
REGIMES = {
    "default": dict(block_size=4, max_model_len=128, enable_prefix_caching=False),
    "chunked-preemption": dict(block_size=4, max_model_len=64, num_kv_blocks=24, max_num_batched_tokens=12,
                               enable_prefix_caching=False),
    "prefix-caching": dict(block_size=4, max_model_len=128, enable_prefix_caching=True),
}


@pytest.fixture(scope="module")
def adapters(llama_model, tmp_path_factory):
    """Three adapters of different ranks, targets and scalings: {name: directory}."""
    root = tmp_path_factory.mktemp("loras")
    return {
        "attn4": make_lora_adapter(root / "attn4", llama_model, rank=4, alpha=8, targets=ATTN, seed=1,
                                   use_rslora=True),
        "all8": make_lora_adapter(root / "all8", llama_model, rank=8, alpha=16, seed=2),
        "mlp16": make_lora_adapter(root / "mlp16", llama_model, rank=16, alpha=8, targets=MLP + ("q_proj",),
                                   seed=3),
    }


def reference(llama_model, adapter_dir, tmp_path_factory, prompt_ids):
    model = llama_model if adapter_dir is None else merged_model(llama_model, adapter_dir,
                                                               tmp_path_factory.getbasetemp())
    return hf_greedy(model, prompt_ids, MAX_NEW)


def check(llm, llama_model, adapters, tmp_path_factory, names, outputs, tol=2e-4):
    tok = llm.get_tokenizer()
    differ = 0
    for (prompt, name), out in zip(names, outputs):
        ids = tok.encode(prompt)
        ref_ids, ref_lp = reference(llama_model, adapters.get(name), tmp_path_factory, ids)
        got = out.outputs[0]
        assert got.token_ids == ref_ids, f"{name}: {prompt!r}: {got.token_ids} != merged transformers {ref_ids}"
        for step, entry in enumerate(got.logprobs):
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(float(ref_lp[step, tid]), abs=tol), (name, prompt, step, tid)
        if name is not None:
            base_ids, _ = reference(llama_model, None, tmp_path_factory, ids)
            differ += base_ids != ref_ids
    assert differ, "the adapters change no output: the comparison could not tell them from the base model"


def mixed_batch():
    """Every prompt under the base model and every adapter, interleaved (same prompts: the prefix cache must keep
    adapters apart)."""
    return [(p, name) for p in PROMPTS for name in (None, "attn4", "all8", "mlp16")]


@pytest.mark.parametrize("regime", list(REGIMES))
def test_mixed_batch_matches_merged_transformers(llama_model, adapters, tmp_path_factory, regime):
    modules = [f"{n}={p}" for n, p in adapters.items()]
    with LLM(model=llama_model, lora_modules=modules, **LORA, **REGIMES[regime]) as llm:
        batch = mixed_batch()
        outputs = llm.generate([p for p, _ in batch], PARAMS, lora_request=[n for _, n in batch], use_tqdm=False)
        check(llm, llama_model, adapters, tmp_path_factory, batch, outputs)
        if regime == "prefix-caching":  # again, now from the cache: still each adapter's own blocks
            outputs = llm.generate([p for p, _ in batch], PARAMS, lora_request=[n for _, n in batch],
                                   use_tqdm=False)
            assert any(o.num_cached_tokens for o in outputs)
            check(llm, llama_model, adapters, tmp_path_factory, batch, outputs)
        if regime == "chunked-preemption":
            assert llm.llm_engine.scheduler.num_preemptions > 0
        llm.llm_engine.pool.check_all_free()


def test_decode_capture_with_adapters_matches_the_uncaptured_run(llama_model, adapters):
    """Decode steps through graph_capture's padded buckets (eager backend: the same static buffers a CUDA graph
    replays, run on CPU) with a mixed batch: the static token -> slot map gives every request its own adapter."""
    modules = [f"{n}={p}" for n, p in adapters.items()]
    batch = mixed_batch()[:11]  # 11 sequences: padded to the 16 bucket, then fewer as requests finish
    params = [PARAMS.clone(max_tokens=MAX_NEW - i % 3) for i in range(len(batch))]
    runs = {}
    for capture in ("none", "eager"):
        with LLM(model=llama_model, lora_modules=modules, decode_capture=capture, **LORA, **REGIMES["default"]) as llm:
            runs[capture] = llm.generate([p for p, _ in batch], params, lora_request=[n for _, n in batch],
                                         use_tqdm=False)
            graphs = llm.llm_engine.executor.runner.decode_graphs
            assert (graphs is not None and graphs.num_padded_steps > 0) == (capture == "eager")
            llm.llm_engine.pool.check_all_free()
    for plain, captured in zip(runs["none"], runs["eager"]):
        assert captured.outputs[0].token_ids == plain.outputs[0].token_ids
        for a, b in zip(plain.outputs[0].logprobs, captured.outputs[0].logprobs):
            assert a.keys() == b.keys()
            for tid in a:
                assert b[tid].logprob == pytest.approx(a[tid].logprob, abs=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [19, 300])  # decode-sized groups (blocks of 1/2/4 tokens) and prefill-sized (of 8)
def test_gathered_kernel_matches_reference(dtype, T):
    """The CPU kernel (grouped shrink/expand per slot) equals the masked dense form, base tokens untouched; it reads
    only each slot's rank rows of each part and each part's own output columns (garbage elsewhere is ignored)."""
    gen = torch.Generator().manual_seed(0)
    S, P, R, n_in, part_out = 4, 3, 8, 37, [24, 9, 17]  # widths off the kernel's 16-lane vectors
    n_out = sum(part_out)
    cols = torch.tensor([0, 24, 33, 50])
    ranks = torch.tensor([[8, 3, 0], [5, 5, 5], [0, 0, 1], [2, 8, 7]])
    x = torch.randn(T, n_in, generator=gen)
    A, B = torch.randn(S, P * R, n_in, generator=gen), torch.randn(S, P * R, n_out, generator=gen)
    clean_A, clean_B = torch.zeros_like(A), torch.zeros_like(B)  # what the slots hold: zero outside each part
    for s in range(S):
        for p in range(P):
            rows = slice(p * R, p * R + int(ranks[s, p]))
            clean_A[s, rows] = A[s, rows]
            clean_B[s, rows, cols[p]:cols[p + 1]] = B[s, rows, cols[p]:cols[p + 1]]
    slots = torch.randint(-1, S, (T,), generator=gen)
    slots[0], slots[1] = -1, 3
    x, A, B = x.to(dtype), A.to(dtype), B.to(dtype)
    y0 = torch.randn(T, n_out, generator=gen).to(dtype)
    got, want = y0.clone(), y0.float().clone()
    lora_apply_(got, x, A, B, slots, ranks, cols)
    lora_apply_reference(want, x.float(), clean_A.to(dtype).float(), clean_B.to(dtype).float(), slots)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * 4)
    assert torch.equal(got[0], y0[0])
    if dtype == torch.float32:  # the 5-argument form (no padding metadata) equals the reference too
        got = y0.clone()
        lora_apply_(got, x, clean_A, clean_B, slots)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_triton_kernel_matches_reference():
    """The Triton kernel (under TRITON_INTERPRET=1 without a GPU): padded ranks, several output blocks, base rows."""
    from shoal.engine.execution.layers import lora_triton

    if lora_triton.triton is None:
        pytest.skip("triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(1)
    S, R, n_in, n_out, T = 3, 24, 80, 150, 7  # R not a power of two, n_in and n_out not multiples of the tiles
    x = torch.randn(T, n_in, generator=gen)
    A, B = torch.randn(S, R, n_in, generator=gen), torch.randn(S, R, n_out, generator=gen)
    slots = torch.tensor([0, -1, 2, 2, 1, -1, 0])
    y0 = torch.randn(T, n_out, generator=gen)
    want = y0.clone()
    lora_apply_reference(want, x, A, B, slots)
    got = y0.to(device)
    lora_triton.lora_apply_triton(got, x.to(device), A.to(device), B.to(device), slots.to(device))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


def test_bad_adapters_are_refused_and_the_engine_keeps_serving(llama_model, adapters, tmp_path, model_factory):
    high = make_lora_adapter(tmp_path / "r32", llama_model, rank=32)
    other = model_factory("llama", hidden_size=64, intermediate_size=96, num_attention_heads=4)
    wrong = make_lora_adapter(tmp_path / "wrong", other, rank=4)
    missing = tmp_path / "missing"
    make_lora_adapter(missing, llama_model, rank=4)
    (missing / "adapter_model.safetensors").unlink()
    with LLM(model=llama_model, **LORA, **REGIMES["default"]) as llm:
        engine = llm.llm_engine
        with pytest.raises(LoRAError, match="rank 32, above --max-lora-rank 16"):
            engine.add_lora("high", str(high))
        with pytest.raises(LoRAError, match="does not fit the base model"):
            engine.add_lora("wrong", str(wrong))
        with pytest.raises(LoRAError, match="no adapter_model.safetensors"):
            engine.add_lora("missing", str(missing))
        with pytest.raises(LoRAError, match="not a directory"):
            engine.add_lora("nowhere", str(tmp_path / "nowhere"))
        with pytest.raises(LoRANotFoundError):
            llm.generate(PROMPTS[:1], PARAMS, lora_request="nope", use_tqdm=False)
        assert engine.list_loras() == []
        engine.add_lora("all8", str(adapters["all8"]))
        with pytest.raises(LoRAError, match="already been loaded"):
            engine.add_lora("all8", str(adapters["all8"]))
        out = llm.generate(PROMPTS[:1], PARAMS, lora_request="all8", use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == MAX_NEW
        engine.pool.check_all_free()


def test_lru_eviction_and_in_use_adapters_stay(llama_model, adapters, tmp_path_factory):
    with LLM(model=llama_model, enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=16,
             **REGIMES["default"]) as llm:
        engine = llm.llm_engine
        reg = engine.lora
        for name in ("attn4", "all8", "mlp16"):
            engine.add_lora(name, str(adapters[name]))
        assert [v.name for v in reg.resident.values()] == ["all8", "mlp16"]  # attn4, least recently used, out
        # A request for the evicted adapter loads it again (evicting all8) and still computes the adapter exactly.
        batch = [(PROMPTS[0], "attn4"), (PROMPTS[1], "mlp16")]
        outputs = llm.generate([p for p, _ in batch], PARAMS, lora_request=[n for _, n in batch], use_tqdm=False)
        assert sorted(v.name for v in reg.resident.values()) == ["attn4", "mlp16"]
        check(llm, llama_model, adapters, tmp_path_factory, batch, outputs)
        # Adapters with requests in flight are never evicted: with both resident ones busy, a third cannot load.
        engine.add_request("a", PROMPTS[0], PARAMS, lora_request="attn4")
        engine.add_request("b", PROMPTS[1], PARAMS, lora_request="mlp16")
        with pytest.raises(LoRACapacityError, match="have requests running"):
            engine.add_request("c", PROMPTS[2], PARAMS, lora_request="all8")
        while engine.has_unfinished_requests():
            engine.step()
        engine.add_request("c", PROMPTS[2], PARAMS, lora_request="all8")
        while engine.has_unfinished_requests():
            engine.step()
        engine.pool.check_all_free()


def test_load_and_unload_while_requests_run(llama_model, adapters, tmp_path_factory):
    opts = dict(REGIMES["chunked-preemption"], enable_prefix_caching=True)
    with LLM(model=llama_model, enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=16, **opts) as llm:
        engine = llm.llm_engine
        engine.add_lora("all8", str(adapters["all8"]))
        names = {}
        for i, prompt in enumerate(PROMPTS * 2):
            names[f"r{i}"] = (prompt, "all8" if i % 2 else None)
            engine.add_request(f"r{i}", prompt, PARAMS, lora_request=names[f"r{i}"][1])
        outputs, steps = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out
            steps += 1
            if steps == 3:  # all8 has requests running: unloading unregisters it, its requests finish under it
                engine.remove_lora("all8")
                with pytest.raises(LoRANotFoundError):
                    engine.add_request("late", PROMPTS[0], PARAMS, lora_request="all8")
                engine.add_lora("attn4", str(adapters["attn4"]))  # loads beside it, as requests keep running
                names["x"] = (PROMPTS[2], "attn4")
                engine.add_request("x", PROMPTS[2], PARAMS, lora_request="attn4")
        assert set(outputs) == set(names)
        assert all(o.outputs[0].finish_reason == "length" for o in outputs.values())
        check(llm, llama_model, adapters, tmp_path_factory, [names[k] for k in outputs], list(outputs.values()))
        assert [v.name for v in engine.lora.resident.values()] == ["attn4"]  # all8 left once its requests did
        engine.pool.check_all_free()


def test_lora_options_are_checked():
    from shoal.engine.config import EngineConfig

    with pytest.raises(ValueError, match="must be name=path"):
        EngineConfig(model="m", enable_lora=True, lora_modules=["nopath"])
    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        EngineConfig(model="m", lora_modules=["a=/x"])
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(model="m", enable_lora=True, max_loras=4, max_cpu_loras=2)
    assert EngineConfig(model="m", enable_lora=True, lora_modules=["a=/x=y", "b=/z"]).lora_paths == {
        "a": "/x=y", "b": "/z"}
