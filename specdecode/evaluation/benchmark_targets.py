"""What the decode benchmark decodes: its held-out prompts, and the targets `run_core_benchmark`
times (the embedded SmolLM2-135M, or random-weight Llamas on random prompts)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from specdecode.data.domains import DOMAINS, load_domain, prompts_within
from specdecode.models.loading import as_target, load_model, resolve_dtype

TARGETS = ("smollm2-135m-instruct", "llama-3.2-1b-shape", "tiny")


def benchmark_prompts(
    tokenizer: PreTrainedTokenizerBase, num_prompts: int, max_tokens: int
) -> list[tuple[str, list[int]]]:
    """The first held-out prompts of each domain within `max_tokens`, interleaved: [(domain, ids)]."""
    pools = {domain: prompts_within(tokenizer, load_domain(domain, split="heldout"), max_tokens) for domain in DOMAINS}
    chosen: list[tuple[str, list[int]]] = []
    while len(chosen) < num_prompts and pools:
        for domain in list(pools):
            found = next(pools[domain], None)
            if found is None:
                del pools[domain]
            elif len(chosen) < num_prompts:
                chosen.append((domain, found[1]))
    if len(chosen) < num_prompts:
        raise ValueError(f"only {len(chosen)} held-out prompts fit max_prompt_tokens={max_tokens}; need {num_prompts}")
    return chosen


def _random_llama(**shape: Any) -> LlamaConfig:
    """A Llama config of `shape` without special tokens (its weights are random: for timing only)."""
    return LlamaConfig(bos_token_id=None, eos_token_id=None, pad_token_id=None, **shape)


def llama_1b_shape() -> LlamaConfig:
    """Llama-3.2-1B's architecture (16 layers, hidden 2048, GQA 32/8, 128k vocabulary), context 4,096."""
    return _random_llama(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    )


def tiny_shape() -> LlamaConfig:
    return _random_llama(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.5,
    )


def build_target(name: str, dtype: str, device: str, count: int) -> tuple[PreTrainedModel, list[list[int]]]:
    """The benchmark's target `name`, eval mode, and `count` prompts (random ids for random targets)."""
    if name not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {name!r}")
    if name == TARGETS[0]:
        # plain linears: the CPU kernel choice (models.cpu_matmul) is another question than the core's
        model, tokenizer = load_model(name, dtype=dtype, device=device, skinny_matmul=False)
        target = as_target(model, name)
        held_out = [ids for _, ids in benchmark_prompts(tokenizer, min(count, 24), max_tokens=256)]
        return target, [held_out[i % len(held_out)] for i in range(count)]
    torch.manual_seed(0)
    config = llama_1b_shape() if name == TARGETS[1] else tiny_shape()
    target = LlamaForCausalLM(config).to(device=device, dtype=resolve_dtype(dtype)).eval()  # type: ignore[call-arg]  # transformers' wrapped `.to` hides its signature
    return target, random_prompts(config.vocab_size, count, (32, 96))


def random_prompts(vocab_size: int, count: int, lengths: tuple[int, int], seed: int = 0) -> list[list[int]]:
    """`count` prompts of random ids with lengths drawn in [lengths[0], lengths[1]]."""
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (count,), generator=generator).tolist()
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in sizes]
