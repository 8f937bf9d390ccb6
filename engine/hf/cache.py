"""`K3Cache`: the engine's per-sequence state behind transformers' `Cache` interface.

transformers' generate keeps whatever the forward returns as `cache` and asks it how many tokens it
holds (`get_seq_length`), so it feeds only the new token each step. The state itself is the
engine's `ModelState` (KDA recurrent + conv states, MLA latent caches and DSA indexer keys), read
and written by the engine's layers exactly as a `Session` does; this class only counts and guards.
It holds one sequence: beam search, several return sequences and cropping (assisted decoding)
need operations a recurrent state cannot undo, and are refused in words.
"""

from __future__ import annotations

import torch
from transformers import Cache

from engine.cache import KDAState, MLACache, ModelState
from engine.errors import InputError


class K3Cache(Cache):
    """Attributes:
        state (ModelState): the engine's state; `state.length` is the number of tokens consumed.
    """

    is_compileable = False

    def __init__(self, state: ModelState) -> None:
        # no transformers layer objects: the engine's layers own their state
        super().__init__(layers=[])
        self.state = state

    def __len__(self) -> int:
        return len(self.state.layers)

    def __repr__(self) -> str:
        kda = sum(isinstance(s, KDAState) for s in self.state.layers)
        mla = sum(isinstance(s, MLACache) for s in self.state.layers)
        return f"K3Cache(tokens={self.state.length}, kda_layers={kda}, mla_layers={mla})"

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.state.length

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1  # the MLA caches grow; the KDA state has no length

    @property
    def batch_size(self) -> int:
        return 1

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def is_croppable(self) -> bool:
        return False

    def reset(self) -> None:
        raise InputError("a K3Cache cannot be reset in place: start a new one (K3ForCausalLM.new_cache())")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise InputError("beam search is not supported by K3ForCausalLM (one sequence, greedy or sampled)")

    def crop(self, tokens_to_remove: int) -> None:
        raise InputError("a K3Cache cannot drop tokens: the KDA state has no per-token history to roll back "
                         "(assisted or speculative decoding is not supported)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise InputError("K3ForCausalLM generates one sequence per call (num_return_sequences / num_beams "
                             "must be 1)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise InputError("K3ForCausalLM's cache holds one sequence; it cannot select batch rows")
