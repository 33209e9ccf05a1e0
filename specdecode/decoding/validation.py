"""Input checks for the decode entry points: every bad value is named before any work is done."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedModel

from specdecode.core.config import GAMMA_RANGE, is_gamma, is_int
from specdecode.decoding.lookup import PromptLookup
from specdecode.decoding.sampling import SamplingParams
from specdecode.models.compat import check_vocab_sizes, default_eos


def validate_models(target: PreTrainedModel, drafter: PreTrainedModel, prompt_lookup: object = None) -> None:
    check_vocab_sizes(target, drafter)
    if target.device != drafter.device:
        raise ValueError(f"target is on {target.device} but drafter is on {drafter.device}")
    if prompt_lookup is not None and not isinstance(prompt_lookup, PromptLookup):
        raise TypeError(f"prompt_lookup must be a PromptLookup or None, got {prompt_lookup!r}")


def validate_request(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    temperature: float,
    top_k: int,
    top_p: float,
    eos_token_ids: Sequence[int] | int | None,
    gamma: int | None = None,
) -> tuple[SamplingParams, list[int], list[int]]:
    """Check a decode request; return the sampling params, one budget per prompt and the EOS ids.

    `gamma` is bounded by `specdecode.core.config.MAX_GAMMA` (64): each step drafts gamma tokens whatever
    the rows' remaining budgets, so an unbounded gamma is unbounded wasted work.
    """
    if gamma is not None and not is_gamma(gamma):
        raise ValueError(f"gamma must be {GAMMA_RANGE}, got {gamma!r}")
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
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
    for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
        if not is_int(budget) or budget < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {budget!r} (prompt {i})")
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise TypeError(f"prompt {i} must be a list of token ids, got {type(prompt).__name__}")
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        bad = next((t for t in prompt if not is_int(t) or not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt {i} holds token id {bad!r}, outside the vocabulary [0, {vocab_size})")
        if context is not None and len(prompt) + budget > context:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens + max_new_tokens {budget} = {len(prompt) + budget}, "
                f"longer than the model's context of {context} tokens"
            )
    if eos_token_ids is None:
        eos = default_eos(model)
    elif is_int(eos_token_ids):
        eos = [eos_token_ids]
    else:
        eos = list(eos_token_ids)
    bad_eos = next((t for t in eos if not is_int(t) or not 0 <= t < vocab_size), None)
    if bad_eos is not None:
        raise ValueError(f"eos_token_ids holds {bad_eos!r}, outside the vocabulary [0, {vocab_size})")
    return params, budgets, eos
