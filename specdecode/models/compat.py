"""What a target and a drafter must share (the tokenizer, the vocabulary size); a model's own EOS
ids; the keyword a model takes a KV cache by."""

from __future__ import annotations

import inspect
from typing import Protocol

import torch
from transformers import LlamaModel, PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from specdecode.core.config import is_int


class Configured(Protocol):
    """A model with a transformers config and an LM head: a causal LM, or a feature drafter wrapping one."""

    @property
    def config(self) -> PreTrainedConfig: ...

    def get_output_embeddings(self) -> torch.nn.Module | None: ...


# The keyword transformers' models take a KV cache by: `cache` from 5.24 on, `past_key_values` before.
CACHE_KWARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword `model`'s forward takes a KV cache by: the one its signature names (a
    remote-code model may name only `past_key_values`), else `CACHE_KWARG` (a `**kwargs` forward)."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), CACHE_KWARG)


def check_tokenizers(target_tokenizer: PreTrainedTokenizerBase, drafter_tokenizer: PreTrainedTokenizerBase) -> None:
    """Require the tokenizers to map ids to the same tokens and share EOS: the target reads the
    drafter's ids as they are, so one differing id silently corrupts the output. The ValueError
    names the first differing id with both tokens, or both EOS ids."""
    target_vocab = {i: token for token, i in target_tokenizer.get_vocab().items()}
    drafter_vocab = {i: token for token, i in drafter_tokenizer.get_vocab().items()}
    if target_vocab != drafter_vocab:
        all_ids = target_vocab.keys() | drafter_vocab.keys()
        first = min(i for i in all_ids if target_vocab.get(i) != drafter_vocab.get(i))
        raise ValueError(
            f"target and drafter tokenizers differ: target vocab has {len(target_vocab)} tokens, "
            f"drafter vocab has {len(drafter_vocab)}; first difference at id {first}: "
            f"{target_vocab.get(first, '<missing>')!r} vs {drafter_vocab.get(first, '<missing>')!r}"
        )
    if target_tokenizer.eos_token_id != drafter_tokenizer.eos_token_id:
        raise ValueError(
            f"target and drafter tokenizers disagree on EOS: target eos_token_id="
            f"{target_tokenizer.eos_token_id} ({target_tokenizer.eos_token!r}), drafter eos_token_id="
            f"{drafter_tokenizer.eos_token_id} ({drafter_tokenizer.eos_token!r})"
        )


def check_vocab_sizes(target: PreTrainedModel, drafter: PreTrainedModel | Configured) -> None:
    """Require the drafter's logits to live in the target's vocabulary; a ValueError names both sizes."""
    target_size = target.config.get_text_config().vocab_size
    drafter_size = drafter.config.get_text_config().vocab_size
    if target_size != drafter_size:
        raise ValueError(
            f"target and drafter vocabularies differ: target config.vocab_size={target_size}, "
            f"drafter config.vocab_size={drafter_size}"
        )


def default_eos(model: PreTrainedModel) -> list[int]:
    """The model's own EOS ids (generation config first, as transformers `generate` does)."""
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if is_int(eos) else list(eos)
