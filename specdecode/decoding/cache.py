"""A KV cache in which every row owns slots [0, lengths[b]) of a preallocated buffer: trimming a
row is lowering its length; the model gets explicit `position_ids` and a 4-D mask.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Self

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from specdecode.decoding.static_buffers import Zeros, fresh_zeros
from specdecode.models.compat import CACHE_KWARG, cache_keyword
from specdecode.models.feature_drafter import FeatureDrafter, target_features


class KVCache(Cache, ABC):
    """The KV cache every decoder drives: per layer, keys and values `[B, H_kv, S_cap, D]` and
    `lengths` `[B]` valid slots per row. `prepare(num_new)` places row b's new tokens at slots
    `lengths[b] + t`; `advance` counts them; `set_lengths` trims."""

    # the keyword `cached_forward_features` passes the cache by (`for_model` sets its model's)
    keyword = CACHE_KWARG

    def __init__(
        self, num_layers: int, batch_size: int, capacity: int, device: torch.device, zeros: Zeros = fresh_zeros
    ) -> None:
        super().__init__(layers=[])
        self.num_layers = num_layers
        self.capacity = capacity
        self.device = torch.device(device)
        self.zeros = zeros
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._write_slots: torch.Tensor | None = None

    @classmethod
    def for_model(
        cls, model: PreTrainedModel | FeatureDrafter, batch_size: int, capacity: int, zeros: Zeros = fresh_zeros
    ) -> Self:
        cache = cls(model.config.num_hidden_layers, batch_size, capacity, model.device, zeros)
        cache.keyword = cache_keyword(model)
        return cache

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed buffer beside the cache, by a `name` unique among its owner's."""
        return self.zeros(name, shape, dtype, self.device)

    @abstractmethod
    def prepare(self, num_new: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Position ids `[B, T]` and the attention mask `[B, 1, T, S]` of a pass of `num_new` tokens
        per row: query t of row b sees exactly slots 0..lengths[b] + t."""

    def _place(self, num_new: int, read: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The position ids `[B, T]` of `num_new` new tokens per row (kept as their write slots), and which
        of the first `read` slots each may attend `[B, 1, T, read]` bool."""
        positions = self.lengths.unsqueeze(1) + torch.arange(num_new, device=self.lengths.device)
        self._write_slots = positions
        slots = torch.arange(read, device=positions.device)
        return positions, (slots.view(1, 1, -1) <= positions.unsqueeze(-1)).unsqueeze(1)

    def advance(self, num_new: int) -> None:
        """Count the pass's tokens as cached (a new tensor: `set_lengths`'s may be the caller's)."""
        self.lengths = self.lengths + num_new

    @abstractmethod
    def set_lengths(self, lengths: torch.Tensor, max_length: int) -> None:
        """Trim (or keep) each row to `lengths` `[B]`; `max_length` is a host-side bound of its max."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows` `[B']` (finished rows leave so they stop costing compute)."""
        for i, (keys, values) in enumerate(zip(self.keys, self.values)):
            if keys is not None and values is not None:
                self.keys[i] = keys.index_select(0, rows)
                self.values[i] = values.index_select(0, rows)
        self.lengths = self.lengths.index_select(0, rows)

    # (keys, values, slots, key_states, value_states): write `[B, H_kv, T, D]` new entries into a layer's
    # `[B, H_kv, S_cap, D]` buffers at the prepared `slots` `[B, T]`; return what attention reads
    _write: Callable[..., tuple[torch.Tensor, torch.Tensor]]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `[B, H_kv, T, D]` new keys/values at each row's slots; return `[B, H_kv, S, D]`."""
        slots = self._write_slots
        if slots is None:
            raise RuntimeError(f"{type(self).__name__}.prepare() must be called before each forward pass")
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if keys is None or values is None:
            batch, heads, _, head_dim = key_states.shape
            shape = (batch, heads, self.capacity, head_dim)
            keys = self.zeros(f"kv.{layer_idx}.keys", shape, key_states.dtype, key_states.device)
            values = self.zeros(f"kv.{layer_idx}.values", shape, value_states.dtype, value_states.device)
            self.keys[layer_idx], self.values[layer_idx] = keys, values
        return self._write(keys, values, slots, key_states, value_states)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.capacity


def write_layer(
    keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write `[B, H_kv, T, D]` keys and values into a layer's `[B, H_kv, S_cap, D]` buffers at `slots` `[B, T]`."""
    # an indexed assignment rather than `scatter_`, which copies the whole buffers on every write on the
    # CPU (a scatter into a compiled graph's input does too); inductor writes this one in place
    rows = torch.arange(key_states.shape[0], device=key_states.device).unsqueeze(1)
    keys[rows, :, slots] = key_states.transpose(1, 2)
    values[rows, :, slots] = value_states.transpose(1, 2)
    return keys, values


class RaggedKVCache(KVCache):
    """The eager core's cache: it reads a window as long as its longest row under an additive mask."""

    max_length = 0
    _read_length = 0

    def prepare(self, num_new: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The position ids and an additive mask over the S = `max_length + num_new` slots read."""
        if self.max_length + num_new > self.capacity:
            raise RuntimeError(f"KV cache overflow: {self.max_length} + {num_new} slots > capacity {self.capacity}")
        self._read_length = self.max_length + num_new
        positions, visible = self._place(num_new, self._read_length)
        mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
        return positions, mask.masked_fill_(~visible, torch.finfo(dtype).min)

    def advance(self, num_new: int) -> None:
        super().advance(num_new)
        self.max_length += num_new

    def set_lengths(self, lengths: torch.Tensor, max_length: int) -> None:
        self.lengths = lengths
        self.max_length = max_length

    def _write(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        slots: torch.Tensor,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        write_layer(keys, values, slots, key_states, value_states)
        return keys[:, :, : self._read_length], values[:, :, : self._read_length]

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.max_length

    @property
    def is_compileable(self) -> bool:
        return False


def cached_forward(
    model: PreTrainedModel, cache: KVCache, input_ids: torch.Tensor, logits_to_keep: int | torch.Tensor = 0
) -> torch.Tensor:
    """Run `input_ids` `[B, T]` after each row's cached tokens → logits `[B, T', V]`
    (`logits_to_keep` as in transformers: 0 all, n the last n, a 1-D tensor those positions)."""
    return cached_forward_features(model, cache, input_ids, logits_to_keep)[0]


def cached_forward_features(
    model: PreTrainedModel,
    cache: KVCache,
    input_ids: torch.Tensor,
    logits_to_keep: int | torch.Tensor = 0,
    *,
    feature_layers: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`cached_forward`'s logits `[B, T', V]` and, with `feature_layers`, the features `[B, T, n·H]`."""
    position_ids, mask = cache.prepare(input_ids.shape[1], model.dtype)
    output = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=position_ids,
        **{cache.keyword: cache},
        use_cache=True,
        logits_to_keep=logits_to_keep,
        output_hidden_states=feature_layers is not None,
    )
    cache.advance(input_ids.shape[1])
    if feature_layers is not None:
        return output.logits, target_features(model, output.hidden_states, feature_layers)
    return output.logits, None


def cached_call(cache: KVCache, num_new: int, dtype: torch.dtype, run: Callable[..., torch.Tensor]) -> torch.Tensor:
    """`run(attention_mask=..., position_ids=..., past_key_values=cache)` for `num_new` new tokens per
    row (models driven by embeddings rather than ids, e.g. feature drafters)."""
    position_ids, mask = cache.prepare(num_new, dtype)
    out = run(attention_mask=mask, position_ids=position_ids, past_key_values=cache)
    cache.advance(num_new)
    return out
