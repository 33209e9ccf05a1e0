"""Tiny random transformers models built in-process (no hub), fp32, seeded."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama_config(**overrides: Any) -> LlamaConfig:
    """A 4-layer, 32-wide Llama config with a 64-token vocabulary and tied embeddings."""
    kwargs: dict[str, Any] = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        # Wide init so logits are far from uniform and greedy argmaxes are not fp32 near-ties.
        initializer_range=0.5,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def tiny_llama(num_layers: int = 2, *, seed: int = 0, vocab_size: int = 64, init: float = 0.5) -> LlamaForCausalLM:
    """A tiny untied Llama with no EOS, so decode tests run to their budget unless told otherwise."""
    torch.manual_seed(seed)
    config = tiny_llama_config(
        num_hidden_layers=num_layers,
        vocab_size=vocab_size,
        initializer_range=init,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config).eval()
