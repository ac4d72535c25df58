"""LoRA under tensor parallelism (gloo, two worker processes): column-parallel layers slice B by output,
row-parallel layers slice A by input; a batch mixing the base model and three adapters equals transformers on the
merged checkpoints."""

from __future__ import annotations

import pytest

from shoal.engine import LLM
from shoal.engine.tools.tiny_lora import ATTN, MLP, make_lora_adapter

pytestmark = pytest.mark.slow


def test_mixed_lora_batch_at_tp2(llama_kv1, tmp_path_factory):
    import test_lora as t  # tests/engine (on sys.path through this folder's conftest)

    root = tmp_path_factory.mktemp("loras-tp")
    adapters = {
        "attn4": make_lora_adapter(root / "attn4", llama_kv1, rank=4, alpha=8, targets=ATTN, seed=1,
                                   use_rslora=True),
        "all8": make_lora_adapter(root / "all8", llama_kv1, rank=8, alpha=16, seed=2),
        "mlp16": make_lora_adapter(root / "mlp16", llama_kv1, rank=16, alpha=8, targets=MLP + ("q_proj",), seed=3),
    }
    with LLM(model=llama_kv1, tensor_parallel_size=2, distributed={"collective_timeout": 120.0},
             lora_modules=[f"{n}={p}" for n, p in adapters.items()], **t.LORA,
             **dict(t.REGIMES["chunked-preemption"], enable_prefix_caching=True)) as llm:
        batch = t.mixed_batch()
        outputs = llm.generate([p for p, _ in batch], t.PARAMS, lora_request=[n for _, n in batch],
                               use_tqdm=False)
        t.check(llm, llama_kv1, adapters, tmp_path_factory, batch, outputs)
        llm.llm_engine.pool.check_all_free()
