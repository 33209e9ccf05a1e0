"""Drafters derived from a target without training: its first layers (`derive_drafter`),
optionally with a truncated vocabulary (`specdecode.models.draft_vocab.DraftVocabHead`)."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from specdecode.models.compat import default_eos
from specdecode.models.draft_vocab import (
    apply_draft_vocab_from_config,
    most_frequent_token_ids,
    truncate_vocab,
    validate_draft_ids,
)

# Config lists with one value per decoder layer (transformers checks their length on save); named,
# since "every list as long as the layer count" would also cut such an `eos_token_id` list.
_PER_LAYER_CONFIG_KEYS = ("layer_types", "no_rope_layers")


def derive_drafter(
    target: PreTrainedModel,
    num_layers: int,
    *,
    draft_vocab: int | Sequence[int] | torch.Tensor | None = None,
    corpus: Iterable[Sequence[int] | torch.Tensor] | None = None,
) -> PreTrainedModel:
    """A drafter of the target's class holding copies (never shared) of its embeddings, first
    `num_layers` decoder layers, final norm and LM head, in eval mode. `draft_vocab`: None (full),
    explicit ids, or an int K: the K most frequent ids of `corpus` (tokenised documents)."""
    text_config = target.config.get_text_config()
    total = text_config.num_hidden_layers
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total:
        raise ValueError(f"num_layers={num_layers!r} must be an int in [1, {total}] (the target's layer count)")
    draft_ids = resolve_draft_vocab(target, draft_vocab, corpus)

    config = copy.deepcopy(target.config)
    _trim_per_layer_config(config.get_text_config(), num_layers)
    # on the meta device: initialising weights about to be overwritten would cost as much as the copy
    with torch.device("meta"):
        drafter = type(target)(config)
    _copy_weights(target, drafter)
    drafter.generation_config = copy.deepcopy(target.generation_config)

    if draft_ids is not None:
        truncate_vocab(drafter, draft_ids)
    else:
        # a truncated target passes its truncation on (its config carries draft_vocab_ids)
        apply_draft_vocab_from_config(drafter)
    drafter.eval()
    return drafter


def resolve_draft_vocab(
    target: PreTrainedModel,
    draft_vocab: int | Sequence[int] | torch.Tensor | None,
    corpus: Iterable[Sequence[int] | torch.Tensor] | None,
) -> torch.Tensor | None:
    """Resolve `derive_drafter`'s `draft_vocab` argument to sorted ids [K], or None."""
    vocab_size = target.config.get_text_config().vocab_size
    if draft_vocab is None:
        return None
    if isinstance(draft_vocab, int) and not isinstance(draft_vocab, bool):
        if corpus is None:
            raise ValueError(
                f"draft_vocab={draft_vocab} needs corpus=... to pick the {draft_vocab} most frequent "
                "tokens; or pass explicit ids (see most_frequent_token_ids)"
            )
        return most_frequent_token_ids(corpus, draft_vocab, vocab_size, always_include=default_eos(target))
    if corpus is not None:
        raise ValueError("corpus=... is only used with an int draft_vocab; explicit ids were given")
    return validate_draft_ids(draft_vocab, vocab_size)  # type: ignore[arg-type]  # a bool is refused there, by name


def _trim_per_layer_config(config: Any, num_layers: int) -> None:
    """Set `num_hidden_layers` and cut the per-layer config lists to the first `num_layers`."""
    for key in _PER_LAYER_CONFIG_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, (list, tuple)):
            setattr(config, key, type(value)(value[:num_layers]))
    config.num_hidden_layers = num_layers


def _copy_weights(target: PreTrainedModel, drafter: PreTrainedModel) -> None:
    """Fill the meta-device `drafter` with copies of the target's tensors of the same names (its
    names are a subset of the target's), non-persistent buffers (RoPE `inv_freq`) included."""
    source_state = target.state_dict()
    state = {}
    for name, meta in drafter.state_dict().items():
        if name not in source_state or source_state[name].shape != meta.shape:
            raise RuntimeError(f"cannot derive the drafter: target has no tensor {name!r} of shape {tuple(meta.shape)}")
        state[name] = source_state[name].detach().clone()
    drafter.load_state_dict(state, strict=True, assign=True)

    source_buffers = dict(target.named_buffers(remove_duplicate=False))
    for name, buffer in list(drafter.named_buffers(remove_duplicate=False)):
        if buffer is not None and buffer.is_meta:
            owner_name, _, leaf = name.rpartition(".")
            owner = drafter.get_submodule(owner_name)
            setattr(owner, leaf, source_buffers[name].detach().clone())

    # The assign-load gave tied tensors (lm_head / embed_tokens) separate copies; tie them again.
    drafter.tie_weights()
    leftover = [n for n, t in [*drafter.named_parameters(), *drafter.named_buffers()] if t.is_meta]
    if leftover:
        raise RuntimeError(f"cannot derive the drafter: no values for {leftover}")
