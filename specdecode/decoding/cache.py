"""A KV cache in which every row of the batch keeps its own length.

Speculative decoding accepts a different number of tokens in each row, so rows drift apart. Rather
than rolling every row back to the batch minimum (recomputing what the others had accepted), each
row owns slots [0, lengths[b]) of a preallocated buffer. Trimming a row after a rejection is just
lowering its length: the rejected entries stay in their slots, hidden by the attention mask, until
the next write overwrites them. Nothing is ever recomputed or copied, except when finished rows
leave the batch.

The model is driven with explicit `position_ids` and a prepared 4-D attention mask, so transformers
skips its own mask construction and never needs to know the rows are ragged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from specdecode.models.compat import CACHE_KWARG, cache_keyword
from specdecode.models.feature_drafter import target_features


class RaggedKVCache(Cache):
    """Per-row-length KV cache for any transformers decoder that calls `Cache.update`.

    Per layer, keys and values are `[B, H_kv, S_cap, D]`. `lengths` `[B]` counts the valid slots of
    each row. A forward pass must be set up with `prepare(num_new)`, which writes the new tokens of
    row b at slots `lengths[b] + t` and returns the matching position ids and attention mask.
    """

    # the keyword `cached_forward` passes the cache by (`for_model` sets its model's)
    keyword = CACHE_KWARG

    def __init__(self, num_layers: int, batch_size: int, capacity: int, device: torch.device) -> None:
        super().__init__(layers=[])
        self.num_layers = num_layers
        self.capacity = capacity
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        # Host-side upper bound of lengths.max(): how many slots attention must read. Kept on the
        # host so that slicing the buffers never waits on the device.
        self.max_length = 0
        self._write_slots: torch.Tensor | None = None
        self._read_length = 0

    @classmethod
    def for_model(cls, model: PreTrainedModel, batch_size: int, capacity: int) -> RaggedKVCache:
        cache = cls(model.config.num_hidden_layers, batch_size, capacity, model.device)
        cache.keyword = cache_keyword(model)
        return cache

    def prepare(self, num_new: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Set up a forward pass that appends `num_new` tokens to every row.

        Returns:
            `position_ids` `[B, T]` and an additive attention mask `[B, 1, T, S]` (0 where a query may
            attend, the dtype's minimum elsewhere), S = the slots read by this pass. Query t of row b
            sees exactly slots 0..lengths[b] + t: its row's history and the new tokens before it.
        """
        if self.max_length + num_new > self.capacity:
            raise RuntimeError(f"KV cache overflow: {self.max_length} + {num_new} slots > capacity {self.capacity}")
        device = self.lengths.device
        positions = self.lengths.unsqueeze(1) + torch.arange(num_new, device=device)
        self._write_slots = positions
        self._read_length = self.max_length + num_new
        slots = torch.arange(self._read_length, device=device)
        visible = slots.view(1, 1, -1) <= positions.unsqueeze(-1)
        mask = torch.zeros(visible.shape, dtype=dtype, device=device)
        mask.masked_fill_(~visible, torch.finfo(dtype).min)
        return positions, mask.unsqueeze(1)

    def advance(self, num_new: int) -> None:
        """Count the tokens of the pass just run as cached (a new tensor: the one `set_lengths` was
        given may be the caller's own)."""
        self.lengths = self.lengths + num_new
        self.max_length += num_new

    def set_lengths(self, lengths: torch.Tensor, max_length: int) -> None:
        """Trim (or keep) each row to `lengths` `[B]`; `max_length` is a host-side bound of its max."""
        self.lengths = lengths
        self.max_length = max_length

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows` `[B']` (finished rows leave so they stop costing compute)."""
        for i in range(self.num_layers):
            if self.keys[i] is not None:
                self.keys[i] = self.keys[i].index_select(0, rows)
                self.values[i] = self.values[i].index_select(0, rows)
        self.lengths = self.lengths.index_select(0, rows)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `[B, H_kv, T, D]` new keys/values at each row's slots; return `[B, H_kv, S, D]` views."""
        if self._write_slots is None:
            raise RuntimeError("RaggedKVCache.prepare() must be called before each forward pass")
        if self.keys[layer_idx] is None:
            batch, heads, _, head_dim = key_states.shape
            shape = (batch, heads, self.capacity, head_dim)
            self.keys[layer_idx] = key_states.new_zeros(shape)
            self.values[layer_idx] = value_states.new_zeros(shape)
        batch, heads, num_new, head_dim = key_states.shape
        index = self._write_slots.view(batch, 1, num_new, 1).expand(batch, heads, num_new, head_dim)
        keys = self.keys[layer_idx].scatter_(2, index, key_states)
        values = self.values[layer_idx].scatter_(2, index, value_states)
        return keys[:, :, : self._read_length], values[:, :, : self._read_length]

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.max_length

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.capacity

    @property
    def is_compileable(self) -> bool:
        return False


def cached_forward(
    model: PreTrainedModel,
    cache: RaggedKVCache,
    input_ids: torch.Tensor,
    logits_to_keep: int | torch.Tensor = 0,
    *,
    feature_layers: Sequence[int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run `input_ids` `[B, T]` after each row's cached tokens → logits `[B, T', V]`.

    `logits_to_keep` as in transformers: 0 = all T positions, n = the last n, a 1-D tensor = those
    positions (the LM head is a large part of a small model's cost, so ask only for what is used).
    With `feature_layers`, also the features of all T positions that a feature drafter reading
    those layers consumes (`target_features`: `[B, T, n·H]`; the post-norm last hidden state,
    what the LM head reads, for the default `(-1,)`).
    """
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
    return output.logits


def cached_call(
    cache: RaggedKVCache, num_new: int, dtype: torch.dtype, run: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """`run(attention_mask=..., position_ids=..., past_key_values=cache)` for `num_new` new tokens per
    row (models driven by embeddings rather than ids, e.g. feature drafters)."""
    position_ids, mask = cache.prepare(num_new, dtype)
    out = run(attention_mask=mask, position_ids=position_ids, past_key_values=cache)
    cache.advance(num_new)
    return out


def padded_prompts(
    prompts: Sequence[Sequence[int]], budgets: Sequence[int], capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ragged batch's token buffer and bounds, on the CPU: `tokens` [B, capacity] (each prompt
    left-aligned, zeros after it), `lengths` [B] (the prompts') and `limits` [B] (length + budget)."""
    tokens = torch.zeros(len(prompts), capacity, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        tokens[i, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    return tokens, lengths, lengths + torch.tensor(list(budgets), dtype=torch.long)
