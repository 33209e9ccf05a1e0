"""Grouped-query attention without copying the keys and values: the decode passes' attention.
With a mask, transformers' SDPA path copies every cached key and value once per query head
(`repeat_kv`), most of a decode pass's attention traffic; here a group's `g` query heads are folded
into `g * T` query rows of their key/value head, and SDPA runs on the cache as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

FOLDED_GQA = "specdecode_folded_gqa"


def folded_gqa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: query `[B, H, T, D]`, key / value `[B, H_kv, S, D]`,
    a mask `[B, 1, T, S]` shared by the heads → `[B, T, H, D]`; anything else goes to transformers' SDPA."""
    groups = getattr(module, "num_key_value_groups", 1)
    if (
        groups == 1
        or attention_mask is None
        or attention_mask.dim() != 4
        or attention_mask.shape[1] != 1
        or module.training
        or dropout
        or kwargs.get("softcap") is not None
        or kwargs.get("s_aux") is not None
    ):
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,  # type: ignore[arg-type]  # transformers' own attention kwargs, passed back as it gave them
        )
    batch, heads, length, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    # head h reads key/value head h // groups, as `repeat_kv` lays them out
    rows = query.reshape(batch, kv_heads, groups * length, dim)
    mask = attention_mask.unsqueeze(2).expand(-1, -1, groups, -1, -1).reshape(batch, 1, groups * length, slots)
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, length, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(FOLDED_GQA, folded_gqa_attention)


@contextlib.contextmanager
def folded_gqa(*models: nn.Module) -> Iterator[None]:
    """Run the `sdpa` attention of `models` (HF models, or anything with such a `config`) as
    `folded_gqa_attention` inside the block; other attention implementations are left alone."""
    switched = []
    for model in models:
        config = getattr(model, "config", None)
        if config is not None and getattr(config, "_attn_implementation", None) == "sdpa":
            config._attn_implementation = FOLDED_GQA
            switched.append(config)
    try:
        yield
    finally:
        for config in switched:
            config._attn_implementation = "sdpa"
