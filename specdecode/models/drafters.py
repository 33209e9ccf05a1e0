"""Drafters derived from a target without training.

* a layer-truncated copy (`derive_drafter(target, num_layers)`): the embeddings, the first
  `num_layers` decoder layers, the final norm and the LM head, copied from the target;
* the same with a truncated vocabulary (`draft_vocab=...`): the LM head only scores K chosen
  token ids (`specdecode.models.draft_vocab.DraftVocabHead`), where a small target's drafter
  spends most of its time.
"""

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

# Config entries holding one value per decoder layer. They must shrink with num_hidden_layers:
# transformers validates e.g. len(layer_types) == num_hidden_layers when the config is saved.
# A whitelist rather than "every list as long as the layer count", which would also cut an
# `eos_token_id` list that happens to have that length.
_PER_LAYER_CONFIG_KEYS = ("layer_types", "no_rope_layers")


def derive_drafter(
    target: PreTrainedModel,
    num_layers: int,
    *,
    draft_vocab: int | Sequence[int] | torch.Tensor | None = None,
    corpus: Iterable[Sequence[int] | torch.Tensor] | None = None,
) -> PreTrainedModel:
    """Build a drafter from the target's own weights: its first `num_layers` decoder layers.

    The drafter has the target's class and a deep-copied config with `num_hidden_layers =
    num_layers` (per-layer config lists trimmed to match). Embeddings, the first `num_layers`
    layers, the final norm and the LM head are copied (never shared), so training the drafter
    leaves the target untouched. Same dtype and device as the target; returned in eval mode.

    `draft_vocab`: None for the full vocabulary; explicit token ids (sequence or [K] tensor); or an
    int K, the K most frequent ids of `corpus` (tokenised documents; EOS always included). With a
    truncated vocabulary the LM head is a `DraftVocabHead`, `config.tie_word_embeddings` is False
    and `config.draft_vocab_ids` lists the ids. A ValueError for a bad `num_layers` (1..the target's
    layer count), bad ids, or an int `draft_vocab` without a corpus.
    """
    text_config = target.config.get_text_config()
    total = text_config.num_hidden_layers
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total:
        raise ValueError(f"num_layers={num_layers!r} must be an int in [1, {total}] (the target's layer count)")
    draft_ids = resolve_draft_vocab(target, draft_vocab, corpus)

    config = copy.deepcopy(target.config)
    _trim_per_layer_config(config.get_text_config(), num_layers)
    # Built on the meta device: allocating and randomly initialising weights that are about to be
    # overwritten would cost as much as the copy itself.
    with torch.device("meta"):
        drafter = type(target)(config)
    _copy_weights(target, drafter)
    drafter.generation_config = copy.deepcopy(target.generation_config)

    if draft_ids is not None:
        truncate_vocab(drafter, draft_ids)
    else:
        # A target that is itself a truncated drafter passes its truncation on (its config carries
        # draft_vocab_ids), so the drafter's config and head agree.
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
    """Fill the meta-device `drafter` with copies of the target tensors of the same names.

    Works for any architecture whose decoder layers are numbered in a ModuleList: the drafter's
    names are then a subset of the target's. Non-persistent buffers (e.g. RoPE `inv_freq`) are
    copied too, since the meta-device init left them empty.
    """
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
