"""Speculative MTP (vLLM's "mtp" method): a tiny DeepSeek V3 checkpoint with a multi-token-prediction layer
(draftkit.mtp_checkpoint). Greedy output equals the non-speculative run and transformers' (batched, chunked prefill
with preemption, prefix caching); the engine's proposals equal a plain-torch MTP forward over transformers' hidden
states (full recompute, transformers' own decoder layer holding the MTP layer's weights); an MTP head made to
predict the target's continuation is accepted where a random one is not; checkpoints and engines MTP cannot serve
are refused at start naming the field."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from draftkit import assert_same_greedy_output, mtp_checkpoint
from hf_reference import hf_greedy, hf_model
from safetensors.torch import load_file, save_file

from shoal.engine import LLM, SamplingParams
from shoal.engine.config import EngineConfig, SpeculativeConfig

PROMPTS = ["one two three four five six one two three", "the cat sat on the mat, the cat",
           "Kubernetes runs pods on nodes", "def f(x): return x + 1"]
MTP = {"method": "mtp", "num_speculative_tokens": 2}
REGIMES = {
    "batched-prefix-caching": dict(block_size=4, max_model_len=128),
    # Eight-token prefill chunks (the MTP layer catches up in chunks too), and a pool too small for the batch.
    "chunked-prefill-preemption": dict(block_size=4, max_model_len=64, num_kv_blocks=20, max_num_batched_tokens=8),
}
LAYER = 3  # the MTP layer's index: the target has 3 layers


@pytest.fixture(scope="module")
def mtp_model(model_factory, tmp_path_factory):
    return mtp_checkpoint(model_factory, tmp_path_factory.mktemp("mtp"))


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def base_outputs(mtp_model):
    """The non-speculative greedy outputs of PROMPTS (the first regime's engine options)."""
    with LLM(model=mtp_model, dtype="float32", **REGIMES["batched-prefix-caching"]) as llm:
        return llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def _run(model, prompts, params, spec, rounds=1, **kw):
    with LLM(model=model, dtype="float32", speculative_config=spec, **kw) as llm:
        outs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(rounds)]
        engine = llm.llm_engine
        engine.pool.check_all_free()  # nothing held after the requests: no leaked blocks
        return outs, engine.get_stats(), engine


def test_config_alias():
    assert SpeculativeConfig(method="deepseek_mtp", num_speculative_tokens=1).method == "mtp"
    with pytest.raises(ValueError, match='"mtp" takes no "model"'):
        SpeculativeConfig(method="mtp", model="/m", num_speculative_tokens=1)
    with pytest.raises(ValueError, match="enable_sleep_mode does not support the speculative method 'mtp'"):
        EngineConfig(model="/m", enable_sleep_mode=True, speculative_config=MTP)


@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_equals_non_speculative_and_transformers(mtp_model, base_outputs, regime):
    """Twice the same prompts in one engine: the second round finds them in the prefix cache (the MTP layer then
    recomputes its entries from the hidden states the cached blocks kept)."""
    spec, stats, engine = _run(mtp_model, PROMPTS, GREEDY, MTP, rounds=2, **REGIMES[regime])
    base = base_outputs  # the engine's options change neither the tokens nor the logprobs
    for outputs in spec:
        assert_same_greedy_output(base, outputs)
    assert stats.spec_decode_num_drafts_total > 0 and stats.spec_decode_num_draft_tokens_total > 0
    tokenizer = engine.tokenizer
    for prompt, out in zip(PROMPTS, spec[0]):
        assert out.outputs[0].token_ids == hf_greedy(mtp_model, tokenizer.encode(prompt), 12)[0], prompt
    if regime == "chunked-prefill-preemption":
        assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for the batch"
    else:
        assert engine.pool.prefix_hits > 0 and all(o.num_cached_tokens > 0 for o in spec[1])


class ReferenceMTP:
    """The MTP forward in plain torch, recomputed whole for every proposal: transformers' hidden states of the
    target (the final norm's output), transformers' DeepseekV3DecoderLayer holding the MTP layer's weights (layer 3
    of the 4-layer model the checkpoint was made from), RMSNorms and projections written out."""

    def __init__(self, mtp_dir, full_dir):
        from transformers import AutoModelForCausalLM

        self.target = hf_model(str(mtp_dir))
        full = AutoModelForCausalLM.from_pretrained(str(full_dir), dtype=torch.float32,
                                                    attn_implementation="eager").eval()
        self.layer, self.rotary = full.model.layers[LAYER], full.model.rotary_emb
        t = load_file(mtp_dir / "model.safetensors")
        p = f"model.layers.{LAYER}."
        self.w = {n: t[f"{p}{n}.weight"] for n in ("enorm", "hnorm", "eh_proj", "shared_head.norm",
                                                  "shared_head.head", "embed_tokens")}
        self.eps = full.config.rms_norm_eps

    def _rms(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    @torch.no_grad()
    def propose(self, token_ids: list[int], k: int) -> list[int]:
        seen = []
        hook = self.target.model.norm.register_forward_hook(lambda m, args, out: seen.append(out[0]))
        try:
            self.target(torch.tensor([token_ids[:-1]]))  # hidden states of positions 0 .. T-2
        finally:
            hook.remove()
        hidden, inputs, proposals = seen[0], list(token_ids[1:]), []  # entry i: token i+1 and h_i
        for _ in range(k):
            n = len(inputs)
            e = self.w["embed_tokens"][torch.tensor(inputs)]  # the MTP layer's own embedding
            x = (torch.cat([self._rms(e, "enorm"), self._rms(hidden, "hnorm")], -1) @ self.w["eh_proj"].T)[None]
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = self.layer(x, attention_mask=mask, position_ids=pos, position_embeddings=self.rotary(x, pos))[0]
            normed = self._rms(out[-1:], "shared_head.norm")
            proposals.append(int((normed[0] @ self.w["shared_head.head"].T).argmax()))
            inputs.append(proposals[-1])
            hidden = torch.cat([hidden, normed])  # the layer's own (normed) output stands in for the next hidden state
        return proposals


def test_proposals_equal_a_reference_mtp_forward(mtp_model, model_factory):
    """Three proposals a step (the layer applied to its own output twice), eight-token chunks, a batch that first
    decodes without speculating (more running sequences than disable_by_batch_size: plain, captured decode steps
    must keep the hidden states too) and a second round from the prefix cache."""
    reference = ReferenceMTP(mtp_model, model_factory("deepseek_v3", num_hidden_layers=4))
    spec = dict(MTP, num_speculative_tokens=3, disable_by_batch_size=2)
    seen = []
    with LLM(model=mtp_model, dtype="float32", speculative_config=spec, block_size=4, max_model_len=128,
             max_num_batched_tokens=8) as llm:
        engine = llm.llm_engine
        drafter = engine.executor.drafter
        propose = drafter.propose

        def recording(requests):
            proposals = propose(requests)
            seen.extend((list(r.token_ids), r.num_draft, p.token_ids) for r, p in zip(requests, proposals))
            return proposals

        drafter.propose = recording
        for _ in range(2):
            llm.generate(PROMPTS[:3], [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                       for n in (6, 10, 14)], use_tqdm=False)
        assert engine.pool.prefix_hits > 0
        graphs = engine.executor.runner.decode_graphs  # the non-speculative steps ran as captured CPU graphs
        assert graphs is not None and graphs.graphs and not graphs.failed
    assert len(seen) >= 6 and any(n == 3 for _, n, _ in seen)
    for token_ids, num_draft, proposed in seen:
        assert proposed == reference.propose(token_ids, num_draft), token_ids


def _predicting_head(mtp_dir, path, base_outputs) -> None:
    """Rewrite mtp_dir's MTP layer into a successor table of the target's own greedy continuations: the decoder
    layer passes its input through (o_proj and the MLP's down projections zero), the hidden state is ignored (hnorm
    zero), and shared_head.head scores each token's normalised (MTP) embedding as the token that followed it."""
    shutil.copytree(mtp_dir, path, dirs_exist_ok=True)
    t = load_file(path / "model.safetensors")
    p = f"model.layers.{LAYER}."
    for name in list(t):
        if name.startswith(p) and name.endswith(("o_proj.weight", "down_proj.weight")):
            t[name] = torch.zeros_like(t[name])
    h = t[p + "enorm.weight"].shape[0]
    t[p + "hnorm.weight"] = torch.zeros(h)
    t[p + "enorm.weight"], t[p + "shared_head.norm.weight"] = torch.ones(h), torch.ones(h)
    t[p + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    embed = t[p + "embed_tokens.weight"]
    unit = embed / embed.norm(dim=-1, keepdim=True)
    successor = {}
    for out in base_outputs:
        ids = out.prompt_token_ids[-1:] + out.outputs[0].token_ids
        successor.update(zip(ids, ids[1:]))
    head = torch.zeros_like(t[p + "shared_head.head.weight"])
    for token, after in successor.items():
        head[after] += 10 * unit[token]
    t[p + "shared_head.head.weight"] = head
    save_file(t, path / "model.safetensors", metadata={"format": "pt"})


def test_an_mtp_head_that_predicts_is_accepted(mtp_model, base_outputs, tmp_path):
    """The same target with the random MTP layer accepts (almost) nothing; with a layer that maps each token to the
    token that followed it in the target's own output, most proposals are accepted and the output is unchanged.
    An MTP layer fed the wrong token (off by one) or a stale position would propose the token after the wrong one."""
    base, kw = base_outputs, REGIMES["batched-prefix-caching"]
    (random_out,), random_stats, _ = _run(mtp_model, PROMPTS, GREEDY, MTP, **kw)
    _predicting_head(mtp_model, tmp_path / "predicting", base)
    (good,), stats, _ = _run(tmp_path / "predicting", PROMPTS, GREEDY, MTP, **kw)
    assert_same_greedy_output(base, random_out)
    assert_same_greedy_output(base, good)
    rate = stats.spec_decode_num_accepted_tokens_total / stats.spec_decode_num_draft_tokens_total
    random_rate = random_stats.spec_decode_num_accepted_tokens_total / random_stats.spec_decode_num_draft_tokens_total
    print(f"acceptance: predicting MTP layer {rate:.2f}, random {random_rate:.2f}")
    assert random_rate < 0.2 < 0.6 < rate
    # Accepted proposals save steps: fewer verification rounds than tokens.
    assert stats.spec_decode_num_drafts_total < 7 * len(PROMPTS)


def _edited(model_dir, path, config=None, drop=()):
    shutil.copytree(model_dir, path, dirs_exist_ok=True)
    if config is not None:
        c = json.loads((path / "config.json").read_text())
        c.update(config)
        for key in [k for k, v in config.items() if v is None]:
            c.pop(key)
        (path / "config.json").write_text(json.dumps(c))
    if drop:
        t = load_file(path / "model.safetensors")
        save_file({k: v for k, v in t.items() if not k.endswith(drop)}, path / "model.safetensors",
                  metadata={"format": "pt"})
    return path


def test_what_mtp_cannot_serve_is_refused_at_start(mtp_model, model_factory, tmp_path):
    def start(model, **kw):
        LLM(model=model, dtype="float32", speculative_config=MTP, block_size=4, max_model_len=64, **kw)

    with pytest.raises(ValueError, match="config field num_nextn_predict_layers is None"):
        start(_edited(mtp_model, tmp_path / "no-field", {"num_nextn_predict_layers": None}))
    with pytest.raises(ValueError, match="config field num_nextn_predict_layers is 0"):
        start(_edited(mtp_model, tmp_path / "zero", {"num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match=r"no MTP layer weights \(missing: model\.layers\.3\.eh_proj\.weight"):
        start(_edited(mtp_model, tmp_path / "no-weights", drop=("eh_proj.weight",)))
    # transformers writes num_nextn_predict_layers: 1 into every DeepSeek V3 config.json it saves, weights or not
    with pytest.raises(ValueError, match=r"no MTP layer weights \(missing: model\.layers\.3\.enorm\.weight"):
        start(model_factory("deepseek_v3"))
    with pytest.raises(ValueError, match="does not support kv_offloading_size"):
        start(mtp_model, kv_offloading_size=0.01)
    with pytest.raises(ValueError, match=r"runs the MTP layers of DeepseekV3ForCausalLM, .*Qwen3NextForCausalLM"
                                         r".* checkpoints, not LlamaForCausalLM"):
        start(model_factory("llama"))
    with pytest.raises(ValueError, match="config field num_nextn_predict_layers is None"):
        start(model_factory("qwen3_next"))  # transformers saves Qwen3-Next without the field (and the layer)


def test_seeded_sampling_with_mtp_is_reproducible_and_frees(mtp_model):
    """Sampled requests draw their proposals from the MTP head's softmax (from the request's generator) and the
    target keeps them by rejection sampling against that distribution: a seed gives the same tokens again."""
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=10, seed=7, ignore_eos=True, n=2)
    (a, b), stats, _ = _run(mtp_model, PROMPTS[:2], params, MTP, rounds=2, block_size=4, max_model_len=128)
    ids = [[c.token_ids for c in o.outputs] for o in a]
    assert ids == [[c.token_ids for c in o.outputs] for o in b]
    assert all(len(c.token_ids) == 10 for o in a for c in o.outputs)
    assert stats.spec_decode_num_draft_tokens_total > 0
