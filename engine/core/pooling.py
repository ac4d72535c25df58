"""Embeddings: which pooling a model serves, and how a prompt's pooled hidden states become its vector.

The pooler is decided once at load, field by field: --pooler-config, else the model's sentence-transformers files
(modules.json naming a Pooling module with its 1_Pooling/config.json, and a Normalize module), else the default
(LAST for a decoder, as vLLM's pooling runner; MEAN for an encoder; normalized). Supported sentence-transformers
pipelines are Transformer -> Pooling (cls, mean or lasttoken) [-> Normalize]; any other module (Dense, max or
weighted-mean pooling...) would change the vector, so such a model is refused at load rather than served wrong.

Matryoshka: `dimensions` keeps the first N components, then renormalizes (when normalizing). Only a model whose
config.json says it was trained for it (`is_matryoshka`, or its `matryoshka_dimensions`) accepts `dimensions`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from shoal.engine.contracts import PoolingParams

_ST_POOLING = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_lasttoken": "LAST"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ST_MODULES = {"Transformer", "Pooling", "Normalize"}


class PoolerError(ValueError):
    """A model directory whose embedding pipeline this engine cannot reproduce (refused at load)."""


@dataclass(frozen=True)
class Pooler:
    pooling_type: str  # LAST | MEAN | CLS
    normalize: bool
    hidden_size: int
    matryoshka: tuple[int, ...] | bool = False  # the dimensions a Matryoshka model accepts (True: any)
    source: str = "default"  # where the pooling came from, for the log

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """The request's PoolingParams with every field decided; ValueError for a dimensions it cannot have."""
        d = params.dimensions
        if d is not None:
            if not self.matryoshka:
                raise ValueError("dimensions is not supported by this model: it was not trained for Matryoshka "
                                 "truncation (its config.json sets neither is_matryoshka nor matryoshka_dimensions)")
            if not 1 <= d <= self.hidden_size:
                raise ValueError(f"dimensions must be in [1, {self.hidden_size}] (the model's embedding size), "
                                 f"got {d}")
            if isinstance(self.matryoshka, tuple) and d not in self.matryoshka:
                raise ValueError(f"dimensions must be one of the model's matryoshka_dimensions "
                                 f"{list(self.matryoshka)}, got {d}")
        return PoolingParams(params.pooling_type or self.pooling_type,
                             self.normalize if params.normalize is None else params.normalize, d)


def finish(pooled: torch.Tensor, num_tokens: int, params: PoolingParams) -> torch.Tensor:
    """The embedding of a prompt of num_tokens from its pooled sum (MEAN) or hidden state (LAST, CLS)."""
    vector = pooled / num_tokens if params.pooling_type == "MEAN" else pooled
    if params.dimensions is not None:
        vector = vector[:params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.float().contiguous()


def make_pooler(model_dir: Path, hf_config, is_encoder: bool, override) -> Pooler:
    """The pooler of a model: `override` (EngineConfig.pooler_config) field by field over the sentence-transformers
    files over the default."""
    pooling, normalize, source = ("MEAN" if is_encoder else "LAST"), True, "default"
    st = _sentence_transformers(model_dir) if model_dir.is_dir() else None
    if st is not None:
        pooling, normalize = st
        source = "sentence-transformers"
    if override is not None and override.pooling_type is not None:
        pooling, source = override.pooling_type, "--pooler-config"
    if override is not None and override.normalize is not None:
        normalize = override.normalize
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    matryoshka: tuple[int, ...] | bool = tuple(dims) if dims else bool(getattr(hf_config, "is_matryoshka", False))
    hidden = getattr(hf_config, "hidden_size", None) or getattr(hf_config, "n_embd")
    return Pooler(pooling, normalize, hidden, matryoshka, source)


def _sentence_transformers(model_dir: Path) -> tuple[str, bool] | None:
    """(pooling type, normalize) from modules.json and the Pooling module's config; None without modules.json."""
    path = model_dir / "modules.json"
    if not path.exists():
        return None
    try:
        modules = json.loads(path.read_text())
        kinds = {m["type"].rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise PoolerError(f"{path}: not a sentence-transformers module list ({e})") from None
    unknown = sorted(set(kinds) - _ST_MODULES)
    if unknown:
        raise PoolerError(f"{path}: sentence-transformers module(s) {', '.join(unknown)} are not supported (this "
                          "engine runs Transformer -> Pooling -> Normalize); the vectors would differ")
    pooling = "MEAN"  # sentence-transformers' own default
    if "Pooling" in kinds:
        cfg_path = model_dir / kinds["Pooling"] / "config.json"
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as e:
            raise PoolerError(f"{cfg_path}: cannot be read ({e})") from None
        bad = [k for k in _ST_UNSUPPORTED if cfg.get(k)]
        chosen = [v for k, v in _ST_POOLING.items() if cfg.get(k)]
        if bad or len(chosen) != 1:
            raise PoolerError(f"{cfg_path}: pooling {', '.join(bad) or 'of ' + str(len(chosen)) + ' kinds at once'} is "
                              "not supported; this engine pools one of cls_token, mean_tokens or lasttoken")
        pooling = chosen[0]
    return pooling, "Normalize" in kinds
