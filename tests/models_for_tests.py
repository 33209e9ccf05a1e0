"""Tiny random transformers models built in-process (no hub), fp32, seeded."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(num_layers: int = 2, *, seed: int = 0, vocab_size: int = 64, init: float = 0.5) -> LlamaForCausalLM:
    """A 32-wide Llama; `init` (initializer_range) large enough that logits are far from uniform,
    so greedy argmaxes are not near-ties that fp32 reordering could flip."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=init,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config).eval()
