"""What a hybrid decoder (paged-attention layers mixed with recurrent layers) adds to the decoder base: its caches.

Attention layers get a paged KVCache each, as every decoder; recurrent layers (Gated DeltaNet, Mamba) get a
fixed-size state per sequence instead, one slot per sequence the engine may run at once (the scheduler hands each
running sequence a slot, core/state_pool.py). A recurrent mixer says what its state costs (`state_bytes`) and makes
it (`allocate_state`); the runner sizes the KV pool with `num_kv_layers` and carves the state from the same budget
with `state_bytes_per_seq`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class LayerCaches:
    """Both caches of a layer that runs attention and a recurrent mixer side by side (Falcon-H1)."""

    kv: object
    state: object

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.state.nbytes

    def copy_slots(self, src, dst) -> None:
        self.state.copy_slots(src, dst)


class HybridCaches:
    """Mixed into a DecoderLM whose recurrent mixers have `state_bytes()` and `allocate_state(slots, device)`. A
    layer whose mixer is neither (Nemotron-H's MLP-only layers) holds no cache at all (None in the list); one whose
    mixer is both (Falcon-H1's parallel attention and Mamba) holds a LayerCaches."""

    has_state = True

    def _is_recurrent(self, layer) -> bool:
        return hasattr(layer.self_attn, "allocate_state")

    def _has_kv(self, layer) -> bool:
        return hasattr(layer.self_attn, "attn")

    @property
    def num_kv_layers(self) -> int:
        """This stage's layers with a paged KV cache."""
        return sum(self._has_kv(layer) for layer in self.layers)

    def state_bytes_per_seq(self) -> int:
        """Bytes of one sequence's recurrent state over this stage's layers."""
        return sum(layer.self_attn.state_bytes() for layer in self.layers if self._is_recurrent(layer))

    def allocate_caches(self, make_kv: Callable[[], object], num_state_slots: int, device) -> list:
        """One cache per local layer, in layer order: a KVCache from make_kv(), a layer's state slots, both, or
        None."""
        caches = []
        for layer in self.layers:
            state = layer.self_attn.allocate_state(num_state_slots, device) if self._is_recurrent(layer) else None
            kv = make_kv() if self._has_kv(layer) else None
            caches.append(LayerCaches(kv, state) if kv is not None and state is not None
                          else kv if kv is not None else state)
        return caches
