"""Speculative decoding on hybrid models (recurrent layers next to attention): the state is backed up before a step
verifies proposals and restored when one is rejected (core/scheduler.accept_draft), for every method: n-gram, a
transformer draft model, and the MTP layer Qwen3-Next and Qwen3.5 checkpoints ship (models/qwen3_next_mtp.py).

Greedy output equals the non-speculative run and transformers' under every regime (batched with prefix caching,
chunked prefill with preemption) and for each kind of recurrent layer (Gated DeltaNet, Mamba2, Mamba, Falcon-H1's
parallel mixer); the MTP proposals equal a plain-torch forward over transformers' hidden states and transformers'
own decoder layer; nothing is left held (KV blocks, state slots)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from draftkit import assert_same_greedy_output
from hf_reference import hf_greedy, hf_model
from hybridkit import MTP_FIELD, NUM_LAYERS, OracleProposer, full_model, qwen_mtp_checkpoint
from safetensors.torch import load_file, save_file

from shoal.engine import LLM, SamplingParams

pytestmark = pytest.mark.numerics

PROMPTS = ["one two three four five six one two three four five six one two", "the cat sat on the mat, the cat",
           "Kubernetes runs pods on nodes", "def f(x): return x + 1"]
MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
REGIMES = {
    "batched-prefix-caching": dict(block_size=4, max_model_len=128),
    # Eight-token chunks (a rejected step's recomputation can be one too) and a pool too small for the batch.
    "chunked-prefill-preemption": dict(block_size=4, max_model_len=64, num_kv_blocks=16, max_num_batched_tokens=8),
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
MTP = {"method": "mtp", "num_speculative_tokens": 2}


def _base(model, **kw):
    with LLM(model=model, dtype="float32", **kw) as llm:
        return llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def _check_freed(engine):
    engine.pool.check_all_free()
    engine.state_pool.check_all_free()


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("family", ["qwen3_next", "granitemoehybrid", "jamba", "falcon_h1"])
def test_rejected_proposals_roll_the_state_back(model_factory, family, regime):
    """Proposals from the reference continuation, right for 0..k of their tokens: twice the same prompts (the
    second round from the prefix cache), greedy output equal to the non-speculative run and to transformers'."""
    model = model_factory(family)
    base = _base(model, **REGIMES["batched-prefix-caching"])
    continuations = [o.prompt_token_ids + o.outputs[0].token_ids for o in base]
    with LLM(model=model, dtype="float32", speculative_config=NGRAM, **REGIMES[regime]) as llm:
        engine = llm.llm_engine
        engine.proposer = OracleProposer(3, continuations, engine.vocab_size)
        rounds = [llm.generate(PROMPTS, GREEDY, use_tqdm=False) for _ in range(2)]
        stats = engine.get_stats()
        for outputs in rounds:
            assert_same_greedy_output(base, outputs)
        accepted, drafted = stats.spec_decode_num_accepted_tokens_total, stats.spec_decode_num_draft_tokens_total
        assert 0.3 * drafted < accepted < 0.7 * drafted  # a half of them right: both paths taken many times
        if regime == "chunked-prefill-preemption":
            assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for the batch"
        else:
            assert engine.pool.prefix_hits > 0 and all(o.num_cached_tokens > 0 for o in rounds[1])
        _check_freed(engine)
    tokenizer = llm.get_tokenizer()
    for prompt, out in zip(PROMPTS[:2], rounds[0]):
        assert out.outputs[0].token_ids == hf_greedy(model, tokenizer.encode(prompt), MAX_NEW)[0], prompt


def test_without_the_roll_back_the_output_diverges(model_factory):
    """The test above can fail: with the backups switched off, the state runs through rejected proposals."""
    model = model_factory("qwen3_next")
    base = _base(model, **REGIMES["batched-prefix-caching"])
    continuations = [o.prompt_token_ids + o.outputs[0].token_ids for o in base]
    with LLM(model=model, dtype="float32", speculative_config=NGRAM, **REGIMES["batched-prefix-caching"]) as llm:
        engine = llm.llm_engine
        engine.proposer = OracleProposer(3, continuations, engine.vocab_size)
        engine.scheduler.backup_base = None
        with pytest.raises(AssertionError, match="left every reference continuation"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_ngram_and_a_transformer_draft_model_on_a_hybrid(model_factory):
    """The real proposers: n-gram, and a transformer draft model (the same tokenizer) for a Qwen3-Next target; a
    hybrid draft model is refused, naming why."""
    model = model_factory("qwen3_next")
    kw = REGIMES["chunked-prefill-preemption"]
    base = _base(model, **kw)
    draft = model_factory("qwen3")
    for spec in (dict(NGRAM, prompt_lookup_min=1), {"method": "draft_model", "model": str(draft),
                                                    "num_speculative_tokens": 2}):
        with LLM(model=model, dtype="float32", speculative_config=spec, **kw) as llm:
            assert_same_greedy_output(base, llm.generate(PROMPTS, GREEDY, use_tqdm=False))
            assert llm.llm_engine.get_stats().spec_decode_num_draft_tokens_total > 0
            _check_freed(llm.llm_engine)
    with pytest.raises(ValueError, match="a hybrid model .*GraniteMoeHybridForCausalLM.* cannot be the draft model"):
        LLM(model=model, dtype="float32", **kw, speculative_config={
            "method": "draft_model", "model": str(model_factory("granitemoehybrid")), "num_speculative_tokens": 2})


def test_seeded_sampling_on_a_hybrid_is_reproducible_and_frees(model_factory):
    model = model_factory("qwen3_next")
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=10, seed=7, ignore_eos=True, n=2)
    with LLM(model=model, dtype="float32", block_size=4, max_model_len=128,
             speculative_config=dict(NGRAM, prompt_lookup_min=1)) as llm:
        a, b = (llm.generate(PROMPTS[:2], params, use_tqdm=False) for _ in range(2))
        assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
        _check_freed(llm.llm_engine)


def test_state_budget_counts_the_backups(model_factory):
    """Each sequence's backup slot comes out of the same budget: the refusal names it and the number that fits."""
    model = model_factory("qwen3_next")
    with pytest.raises(ValueError, match=r"--max-num-seqs 256 needs .* MiB per sequence, with its prefix-cache "
                                         r"checkpoint and its speculative backup\).* at most \d+ sequences"):
        LLM(model=model, block_size=4, max_model_len=64, max_num_seqs=256, kv_cache_memory=4 * 2**20,
            speculative_config=NGRAM)


# -- MTP -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_mtp(model_factory, tmp_path_factory):
    return qwen_mtp_checkpoint(model_factory, tmp_path_factory.mktemp("qwen3-next-mtp"))


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_mtp_greedy_equals_non_speculative_and_transformers(model_factory, tmp_path, family, regime):
    """Qwen3-Next, Qwen3.5 dense (a vision-language checkpoint: its MTP layer's MLP dense) and Qwen3.5 MoE."""
    model = qwen_mtp_checkpoint(model_factory, tmp_path / family, family)
    base = _base(model, **REGIMES["batched-prefix-caching"])
    with LLM(model=model, dtype="float32", speculative_config=MTP, **REGIMES[regime]) as llm:
        engine = llm.llm_engine
        rounds = [llm.generate(PROMPTS, GREEDY, use_tqdm=False) for _ in range(2)]
        for outputs in rounds:
            assert_same_greedy_output(base, outputs)
        assert engine.get_stats().spec_decode_num_draft_tokens_total > 0
        if regime == "chunked-prefill-preemption":
            assert engine.scheduler.num_preemptions > 0
        else:
            assert engine.pool.prefix_hits > 0
        _check_freed(engine)
    tokenizer = llm.get_tokenizer()
    out = rounds[0][0]
    assert out.outputs[0].token_ids == hf_greedy(model, tokenizer.encode(PROMPTS[0]), MAX_NEW)[0]


def _gemma_rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


class ReferenceQwenMTP:
    """The Qwen3-Next MTP forward in plain torch, recomputed whole for every proposal: transformers' hidden states
    of the target (its final norm's output), transformers' Qwen3NextDecoderLayer holding the MTP layer's weights
    (layer 4 of the 5-layer model the checkpoint was made from), the norms and fc written out."""

    def __init__(self, mtp_dir, full_dir):
        from transformers import AutoModelForCausalLM

        self.target = hf_model(str(mtp_dir))
        full = AutoModelForCausalLM.from_pretrained(str(full_dir), dtype=torch.float32,
                                                    attn_implementation="eager").eval()
        self.layer, self.rotary = full.model.layers[NUM_LAYERS], full.model.rotary_emb
        t = load_file(mtp_dir / "model.safetensors")
        self.w = {n: t[f"mtp.{n}.weight"] for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm", "fc")}
        self.eps = full.config.rms_norm_eps

    @torch.no_grad()
    def propose(self, token_ids: list[int], k: int) -> list[int]:
        seen = []
        hook = self.target.model.norm.register_forward_hook(lambda m, args, out: seen.append(out[0]))
        try:
            self.target(torch.tensor([token_ids[:-1]]))  # hidden states of positions 0 .. T-2
        finally:
            hook.remove()
        hidden, inputs, proposals = seen[0], list(token_ids[1:]), []  # entry i: token i+1 and h_i
        embed, head = self.target.model.embed_tokens.weight, self.target.lm_head.weight
        for _ in range(k):
            n = len(inputs)
            e = _gemma_rms(embed[torch.tensor(inputs)], self.w["pre_fc_norm_embedding"], self.eps)
            x = (torch.cat([e, _gemma_rms(hidden, self.w["pre_fc_norm_hidden"], self.eps)], -1) @ self.w["fc"].T)[None]
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = self.layer(x, position_embeddings=self.rotary(x, pos), attention_mask=mask, position_ids=pos)
            out = out[0] if isinstance(out, tuple) else out
            normed = _gemma_rms(out[0, -1:], self.w["norm"], self.eps)
            proposals.append(int((normed[0] @ head.T).argmax()))
            inputs.append(proposals[-1])
            hidden = torch.cat([hidden, normed])  # the layer's normed output stands in for the next hidden state
        return proposals


def test_mtp_proposals_equal_a_reference_forward(qwen_mtp, model_factory):
    """Three proposals a step (the layer applied to its own output twice), eight-token chunks (the MTP layer
    catches up in chunks too) and a second round from the prefix cache."""
    reference = ReferenceQwenMTP(qwen_mtp, full_model(model_factory, "qwen3_next"))
    seen = []
    with LLM(model=qwen_mtp, dtype="float32", speculative_config=dict(MTP, num_speculative_tokens=3),
             block_size=4, max_model_len=128, max_num_batched_tokens=8) as llm:
        engine = llm.llm_engine
        propose = engine.executor.drafter.propose

        def recording(requests):
            proposals = propose(requests)
            seen.extend((list(r.token_ids), r.num_draft, p.token_ids) for r, p in zip(requests, proposals))
            return proposals

        engine.executor.drafter.propose = recording
        for _ in range(2):
            llm.generate(PROMPTS[:3], [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                       for n in (6, 10, 14)], use_tqdm=False)
        assert engine.pool.prefix_hits > 0
        _check_freed(engine)
    assert len(seen) >= 6 and any(n == 3 for _, n, _ in seen)
    for token_ids, num_draft, proposed in seen:
        assert proposed == reference.propose(token_ids, num_draft), token_ids


def _predicting_layer(mtp_dir, path, base) -> None:
    """Rewrite mtp_dir's MTP layer into a successor table of the target's own greedy continuations: the decoder
    layer passes its input through (o_proj and every down projection zero), the hidden state is ignored (its half
    of fc zero), and fc maps each token's normalised embedding onto the LM-head row of the token that followed it
    (a least-squares fit over the few tokens involved: fewer than the hidden size)."""
    shutil.copytree(mtp_dir, path, dirs_exist_ok=True)
    t = load_file(path / "model.safetensors")
    for name in list(t):
        if name.startswith("mtp.layers.0.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            t[name] = torch.zeros_like(t[name])
    successor = {}
    for out in base:
        ids = out.prompt_token_ids[-1:] + out.outputs[0].token_ids
        successor.update(zip(ids, ids[1:]))
    embed, head = t["model.embed_tokens.weight"], t["lm_head.weight"]
    h = embed.shape[1]
    for name in ("pre_fc_norm_embedding", "norm"):
        t[f"mtp.{name}.weight"] = torch.zeros(h)
    tokens = list(successor)
    e = embed[tokens] / embed[tokens].pow(2).mean(-1, keepdim=True).sqrt()
    target = head[[successor[k] for k in tokens]] * 10
    fit = torch.linalg.lstsq(e, target).solution.T  # [H, H]: fit @ e_t ~ head row of successor(t)
    t["mtp.fc.weight"] = torch.cat([fit, torch.zeros(h, h)], dim=1)
    save_file(t, path / "model.safetensors", metadata={"format": "pt"})


def test_an_mtp_layer_that_predicts_is_accepted(qwen_mtp, tmp_path):
    """The random MTP layer is (almost) never accepted; one that maps each token to the token after it in the
    target's own output mostly is, and the output stays the target's: the accepted path keeps the state it
    computed, the rejected one restores it."""
    kw = REGIMES["batched-prefix-caching"]
    base = _base(qwen_mtp, **kw)
    _predicting_layer(qwen_mtp, tmp_path / "predicting", base)
    rates = {}
    for name, model in (("random", qwen_mtp), ("predicting", tmp_path / "predicting")):
        with LLM(model=model, dtype="float32", speculative_config=MTP, **kw) as llm:
            assert_same_greedy_output(base, llm.generate(PROMPTS, GREEDY, use_tqdm=False))
            stats = llm.llm_engine.get_stats()
            rates[name] = stats.spec_decode_num_accepted_tokens_total / stats.spec_decode_num_draft_tokens_total
            _check_freed(llm.llm_engine)
    print(f"acceptance: {rates}")
    assert rates["random"] < 0.2 < 0.6 < rates["predicting"]


def test_what_qwen_mtp_cannot_serve_is_refused(qwen_mtp, model_factory, tmp_path):
    def start(model):
        LLM(model=model, dtype="float32", speculative_config=MTP, block_size=4, max_model_len=64)

    broken = tmp_path / "no-fc"
    shutil.copytree(qwen_mtp, broken)
    t = load_file(broken / "model.safetensors")
    del t["mtp.fc.weight"]
    save_file(t, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers is 1, but the checkpoint has no MTP layer "
                                         r"weights \(missing: mtp\.fc\.weight\)"):
        start(broken)
    zero = tmp_path / "zero"
    shutil.copytree(qwen_mtp, zero)
    config = json.loads((zero / "config.json").read_text())
    config[MTP_FIELD["qwen3_next"]] = 0
    (zero / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config field num_nextn_predict_layers is 0"):
        start(zero)
    with pytest.raises(ValueError, match="config field mtp_num_hidden_layers is None"):
        start(model_factory("qwen3_5_moe"))
