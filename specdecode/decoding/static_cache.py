"""A KV cache of fixed shape in which every row keeps its own length: the static core's cache.

`RaggedKVCache` (cache.py) reads a window that grows with the longest row and builds an additive
float mask for it, so every pass has a new shape. Here the buffers are read whole and the mask is
boolean (SDPA can then pick its efficient kernels), so a pass's shapes depend only on its batch
size and width, and a compiled forward can be replayed step after step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from specdecode.decoding.compiled import mark_static
from specdecode.decoding.layer_kv import write_layer
from specdecode.decoding.static_buffers import Zeros, fresh_zeros
from specdecode.models.compat import CACHE_KWARG, cache_keyword
from specdecode.models.feature_drafter import FeatureDrafter

# The cache capacity is rounded up to a power of two (at least this), so calls whose prompts and
# budgets differ share one compiled shape, at most twice the slots they need: unused slots are
# masked, and reading them costs little next to the weights (256 slots of SmolLM2-135M's keys and
# values are ~6 MB per row against its 540 MB of weights).
MIN_CAPACITY = 16


def decode_slack(gamma: int | None) -> int:
    """Slots a static decode writes past a row's budget: a speculative round's gamma drafts, its bonus
    token and the pending one (gamma + 2); a step of the target alone (`gamma` None) 1."""
    return 1 if gamma is None else gamma + 2


def rows_capacity(
    prompts: Sequence[Sequence[int]], budgets: Sequence[int], gamma: int | None, capacity: int | None = None
) -> int:
    """The cache capacity of a static decode of `prompts` with `budgets` (`static_capacity`)."""
    return static_capacity(max(len(p) + b for p, b in zip(prompts, budgets)) + decode_slack(gamma), capacity)


def static_capacity(slots: int, capacity: int | None = None) -> int:
    """The capacity of the static caches of a decode that needs `slots` slots per row: `capacity`
    where the caller fixes it (so that calls of other lengths share compiled graphs), else `slots`
    rounded up to a power of two.

    Raises:
        ValueError: `capacity` is not an int of at least `slots`.
    """
    if capacity is None:
        return max(MIN_CAPACITY, 1 << (slots - 1).bit_length())
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < slots:
        raise ValueError(
            f"capacity must be an int of at least {slots} cache slots (the longest prompt + its max_new_tokens "
            f"+ the core's slack), got {capacity!r}"
        )
    return capacity


class StaticKVCache(Cache):
    """A KV cache of fixed shape in which every row keeps its own length.

    Per layer, keys and values are `[B, H_kv, S_cap, D]`, taken from `zeros` (default: allocated)
    at the first write (the prefill, which runs eagerly) and never reallocated. The interface is `RaggedKVCache`'s, so
    `cached_forward`, `cached_call` and the drafting strategies drive either: `prepare(T)` sets
    up a pass that writes row b's T new tokens at slots `lengths[b] + t` and returns their
    positions and a boolean mask `[B, 1, T, S_cap]`; `update` writes the new entries there and
    returns the whole buffers. Lowering a row's length trims it: stale entries stay, masked, until
    overwritten. The host-side `max_length` of `set_lengths` is not needed (reads are whole).
    """

    # the keyword `cached_forward` passes the cache by (`for_model` sets its model's)
    keyword = CACHE_KWARG

    def __init__(
        self, num_layers: int, batch_size: int, capacity: int, device: torch.device, zeros: Zeros = fresh_zeros
    ) -> None:
        super().__init__(layers=[])
        self._zeros = zeros
        self.num_layers = num_layers
        self.capacity = capacity
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.slots = torch.arange(capacity, device=device)
        self._write_slots: torch.Tensor | None = None

    @classmethod
    def for_model(
        cls, model: PreTrainedModel | FeatureDrafter, batch_size: int, capacity: int, zeros: Zeros = fresh_zeros
    ) -> StaticKVCache:
        cache = cls(model.config.num_hidden_layers, batch_size, capacity, model.device, zeros)
        cache.keyword = cache_keyword(model)
        return cache

    def prepare(self, num_new: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Position ids `[B, T]` and the boolean mask `[B, 1, T, S_cap]` of a pass of `num_new`
        tokens per row (True where a query may attend: slots 0..lengths[b] + t). `dtype` is unused
        (the ragged cache's additive mask needs it)."""
        positions = self.lengths.unsqueeze(1) + torch.arange(num_new, device=self.lengths.device)
        self._write_slots = positions
        return positions, (self.slots.view(1, 1, -1) <= positions.unsqueeze(-1)).unsqueeze(1)

    def advance(self, num_new: int) -> None:
        self.lengths = self.lengths + num_new

    def set_lengths(self, lengths: torch.Tensor, max_length: int | None = None) -> None:
        """Trim (or keep) each row to `lengths` `[B]`."""
        self.lengths = lengths

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `[B, H_kv, T, D]` new keys/values at each row's slots; return the `[B, H_kv, S_cap, D]` buffers."""
        if self._write_slots is None:
            raise RuntimeError("StaticKVCache.prepare() must be called before each forward pass")
        batch, heads, num_new, head_dim = key_states.shape
        if self.keys[layer_idx] is None:
            shape = (batch, heads, self.capacity, head_dim)
            self.keys[layer_idx] = self._zeros(f"kv.{layer_idx}.keys", shape, key_states.dtype, key_states.device)
            self.values[layer_idx] = self._zeros(
                f"kv.{layer_idx}.values", shape, value_states.dtype, value_states.device
            )
            # fixed addresses: CUDA graphs may then write them in place
            mark_static(self.keys[layer_idx], self.values[layer_idx])
        return write_layer(self.keys[layer_idx], self.values[layer_idx], self._write_slots, key_states, value_states)

    def layer_buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Layer `layer_idx`'s keys, values and the pass's write slots `[B, T]`, once the layer's
        buffers exist and a pass is prepared (a nested layer region takes them as its inputs:
        `compiled.nested_layers`); else None."""
        if self.keys[layer_idx] is None or self._write_slots is None:
            return None
        return self.keys[layer_idx], self.values[layer_idx], self._write_slots

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.capacity

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.capacity

    @property
    def is_compileable(self) -> bool:
        return True
