"""Input checks for the decode entry points: every bad value is named before any work is done."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch
from transformers import PreTrainedModel

from specdecode.core.config import GAMMA_RANGE, is_gamma, is_int
from specdecode.decoding.lookup import PromptLookup
from specdecode.models.compat import check_vocab_sizes, default_eos
from specdecode.models.feature_drafter import FeatureDrafter, check_fits_target


def validate_models(
    target: PreTrainedModel, drafter: PreTrainedModel | FeatureDrafter, prompt_lookup: object = None
) -> None:
    """Check that `drafter` can draft for `target` (one vocabulary and device; a feature drafter's
    sizes and layers) and that `prompt_lookup` is a `PromptLookup` or None, naming what differs."""
    check_vocab_sizes(target, drafter)
    if isinstance(drafter, FeatureDrafter):
        check_fits_target(drafter, target)
    if target.device != drafter.device:
        raise ValueError(f"target is on {target.device} but drafter is on {drafter.device}")
    if prompt_lookup is not None and not isinstance(prompt_lookup, PromptLookup):
        raise TypeError(f"prompt_lookup must be a PromptLookup or None, got {prompt_lookup!r}")


def _token_id(value: object) -> int | None:
    """`value` as a token id: an int, a NumPy integer or a 0-d integer tensor (what indexing a
    tensor or an array of ids gives); None for anything else, bools and floats included."""
    if isinstance(value, (bool, np.bool_)) or (
        isinstance(value, torch.Tensor) and (value.dim() != 0 or value.dtype == torch.bool)
    ):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]  # any object; a TypeError means no index
    except TypeError:
        return None


def _items(value: object) -> list[object] | None:
    """`value` as a list of its items: a sequence (not a string or bytes) or a 1-D tensor / array; else None."""
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 1:
        return value.tolist()
    return list(value) if isinstance(value, Sequence) and not isinstance(value, (str, bytes)) else None


def _ints(value: object) -> list[int] | None:
    """`value`'s items as token ids (`_items`, `_token_id`), or None where it is no list of them."""
    items = _items(value)
    ids = None if items is None else [_token_id(t) for t in items]
    return None if ids is None or None in ids else [i for i in ids if i is not None]


def _token_ids(prompt: object, i: int) -> list[int]:
    """Prompt `i` as a list of ints; errors name the first non-integer."""
    items = _items(prompt)
    if items is None:
        raise TypeError(f"prompt {i} must be a list of token ids, got {type(prompt).__name__}")
    ids = [_token_id(t) for t in items]
    if None in ids:
        bad = items[ids.index(None)]
        raise ValueError(f"prompt {i} holds {bad!r} ({type(bad).__name__}): token ids are ints")
    return [t for t in ids if t is not None]


def _eos_ids(eos_token_ids: object) -> list[int]:
    """`eos_token_ids` (one id or a sequence of them) as a list of ints; ValueError naming anything else."""
    eos = _ints([eos_token_ids]) or _ints(eos_token_ids)
    if eos is None:
        raise ValueError(f"eos_token_ids must be an int token id, a list of them or None, got {eos_token_ids!r}")
    return eos


def check_seed(seed: object) -> int | None:
    """`seed` as an int or None (TypeError naming anything else, bools included)."""
    if seed is None:
        return None
    value = _token_id(seed)
    if value is None:
        raise TypeError(f"seed must be an int or None, got {seed!r} ({type(seed).__name__})")
    return value


def check_feature_layers(feature_layers: object, num_layers: int) -> tuple[int, ...] | None:
    """`feature_layers` as a tuple of the target's hidden-state indices in `[-1, num_layers]`, or None."""
    if feature_layers is None:
        return None
    layers = _ints(feature_layers)
    if not layers:
        raise TypeError(f"feature_layers must be a non-empty list of layer indices or None, got {feature_layers!r}")
    bad = next((i for i in layers if not -1 <= i <= num_layers), None)
    if bad is not None:
        raise ValueError(f"feature_layers holds {bad}, outside the target's hidden states [-1, {num_layers}]")
    return tuple(layers)


def validate_request(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    eos_token_ids: Sequence[int] | int | None,
    gamma: int | None = None,
) -> tuple[list[int], list[int], list[list[int]]]:
    """Check a decode request; return one budget per prompt, the EOS ids and the prompts as lists of
    ints. `gamma` is bounded by `MAX_GAMMA`: each step drafts gamma tokens whatever the budgets left."""
    if gamma is not None and not is_gamma(gamma):
        raise ValueError(f"gamma must be {GAMMA_RANGE}, got {gamma!r}")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: pass at least one prompt")
    if is_int(max_new_tokens):
        budgets = [max_new_tokens] * len(prompts)
    elif isinstance(max_new_tokens, Sequence) and len(max_new_tokens) == len(prompts):
        budgets = list(max_new_tokens)
    else:
        raise ValueError(f"max_new_tokens must be an int or one int per prompt, got {max_new_tokens!r}")
    vocab_size = model.config.vocab_size
    context = getattr(model.config, "max_position_embeddings", None)
    token_ids = [_token_ids(prompt, i) for i, prompt in enumerate(prompts)]
    for i, (prompt, budget) in enumerate(zip(token_ids, budgets)):
        if not is_int(budget) or budget < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {budget!r} (prompt {i})")
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt {i} holds token id {bad!r}, outside the vocabulary [0, {vocab_size})")
        if context is not None and len(prompt) + budget > context:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens + max_new_tokens {budget} = {len(prompt) + budget}, "
                f"longer than the model's context of {context} tokens"
            )
    eos = default_eos(model) if eos_token_ids is None else _eos_ids(eos_token_ids)
    bad_eos = next((t for t in eos if not is_int(t) or not 0 <= t < vocab_size), None)
    if bad_eos is not None:
        raise ValueError(f"eos_token_ids holds {bad_eos!r}, outside the vocabulary [0, {vocab_size})")
    return budgets, eos, token_ids
