"""Drafters derived from a target without training.

* a layer-truncated copy (`derive_drafter(target, num_layers)`): the embeddings, the first
  `num_layers` decoder layers, the final norm and the LM head, copied from the target;
* the same with a truncated vocabulary (`draft_vocab=...`): the LM head only scores K chosen
  token ids (`DraftVocabHead`). For small targets the head dominates the drafter's cost (SmolLM2's
  49,152 x 576 head is ~28M of its 135M parameters), so scoring K << V ids is where the speed is.

On disk a truncated drafter is a plain full-vocab checkpoint plus `config.draft_vocab_ids`; see
`DraftVocabHead` for how the round trip works.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from specdecode.models.compat import default_eos

# Config entries holding one value per decoder layer. They must shrink with num_hidden_layers:
# transformers validates e.g. len(layer_types) == num_hidden_layers when the config is saved.
# A whitelist rather than "every list as long as the layer count", which would also cut an
# `eos_token_id` list that happens to have that length.
_PER_LAYER_CONFIG_KEYS = ("layer_types", "no_rope_layers")


class DraftVocabHead(nn.Module):
    """An LM head that scores only K draft token ids but returns full-vocabulary logits.

    `forward` computes `hidden @ weight.T` for the K ids (the expensive matmul shrinks from V x H
    to K x H) and scatters the result into a [.., V] tensor filled with `finfo(dtype).min`.
    The fill is the most negative finite value rather than -inf, so softmax gives exact zeros
    while log-probabilities stay finite: `0 * log q` terms in KL losses give 0, not NaN.

    Checkpoints stay plain: `state_dict()` reports `weight` as the full [V, H] matrix (the
    target's original head, with the draft rows replaced by the current, possibly trained,
    `weight`), and `load_state_dict()` accepts that [V, H] matrix back. The draft ids live in
    `config.draft_vocab_ids`, not in the state dict, so any HF loader sees an ordinary LM head.

    Attributes:
        weight: [K, H] trainable rows of the head for `draft_ids`.
        bias: [K] or None.
        draft_ids: [K] long buffer, sorted ascending.
        base_weight: [V, H] frozen full head the checkpoint is rebuilt from.
        base_bias: [V] or None.
    """

    def __init__(
        self, full_weight: torch.Tensor, draft_ids: torch.Tensor, full_bias: torch.Tensor | None = None
    ) -> None:
        """Build from a full head.

        Args:
            full_weight: [V, H] full LM-head weight; copied, never aliased.
            draft_ids: [K] token ids to score, validated by `validate_draft_ids`.
            full_bias: [V] LM-head bias, or None.
        """
        super().__init__()
        vocab_size = full_weight.shape[0]
        draft_ids = validate_draft_ids(draft_ids, vocab_size).to(full_weight.device)
        self.vocab_size = vocab_size
        self.register_buffer("draft_ids", draft_ids, persistent=False)
        self.register_buffer("base_weight", full_weight.detach().clone(), persistent=False)
        self.weight = nn.Parameter(full_weight.detach()[draft_ids].clone())
        if full_bias is None:
            self.register_buffer("base_bias", None, persistent=False)
            self.register_parameter("bias", None)
        else:
            self.register_buffer("base_bias", full_bias.detach().clone(), persistent=False)
            self.bias = nn.Parameter(full_bias.detach()[draft_ids].clone())
        self.register_state_dict_post_hook(_draft_head_state_dict_hook)
        self.register_load_state_dict_pre_hook(_draft_head_load_hook)

    @classmethod
    def from_linear(cls, head: nn.Linear, draft_ids: torch.Tensor | Sequence[int]) -> DraftVocabHead:
        """Truncate a full `nn.Linear` head [V, H] to `draft_ids`."""
        return cls(head.weight, torch.as_tensor(draft_ids), head.bias)

    def full_weight(self) -> torch.Tensor:
        """[V, H]: the base head with the draft rows replaced by the current `weight`."""
        full = self.base_weight.clone()
        full[self.draft_ids] = self.weight.detach()
        return full

    def full_bias(self) -> torch.Tensor | None:
        """[V] counterpart of `full_weight` for the bias, or None."""
        if self.bias is None:
            return None
        full = self.base_bias.clone()
        full[self.draft_ids] = self.bias.detach()
        return full

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Score the draft ids.

        Args:
            hidden: [B, T, H] final hidden states.

        Returns:
            [B, T, V] logits: `hidden @ weight.T (+ bias)` at `draft_ids`, `finfo.min` elsewhere.
        """
        draft_logits = F.linear(hidden, self.weight, self.bias)  # [B, T, K]
        logits = draft_logits.new_full(
            (*draft_logits.shape[:-1], self.vocab_size), torch.finfo(draft_logits.dtype).min
        )
        return logits.index_copy(-1, self.draft_ids, draft_logits)

    def extra_repr(self) -> str:
        return (
            f"draft_vocab={self.draft_ids.numel()}, vocab_size={self.vocab_size}, "
            f"hidden_size={self.weight.shape[1]}, bias={self.bias is not None}"
        )


def _draft_head_state_dict_hook(
    module: DraftVocabHead, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any]
) -> None:
    """Report the head as the plain full [V, H] matrix (and [V] bias) a stock loader expects."""
    state_dict[prefix + "weight"] = module.full_weight()
    if module.bias is not None:
        state_dict[prefix + "bias"] = module.full_bias()


def _draft_head_load_hook(
    module: DraftVocabHead,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Accept the full [V, H] head written by `_draft_head_state_dict_hook`: keep it as the base
    and load its draft rows into `weight`. Any other shape is left for torch to report."""
    for name, base_name in (("weight", "base_weight"), ("bias", "base_bias")):
        key = prefix + name
        full = state_dict.get(key)
        base = getattr(module, base_name)
        if full is None or base is None or full.shape != base.shape:
            continue
        with torch.no_grad():
            base.copy_(full)
        state_dict[key] = full[module.draft_ids.to(full.device)]


def draft_vocab_ids(drafter: PreTrainedModel) -> torch.Tensor:
    """[K] ids the drafter's head scores: its draft ids, or all V for a full head."""
    head = drafter.get_output_embeddings()
    if isinstance(head, DraftVocabHead):
        return head.draft_ids.cpu()
    return torch.arange(drafter.config.get_text_config().vocab_size)


def validate_draft_ids(draft_ids: Sequence[int] | torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Check explicit draft token ids and return them as a sorted [K] long tensor.

    Raises:
        ValueError: naming the offending value if the ids are empty, not integers, not 1-D,
            outside [0, vocab_size), or repeated.
    """
    ids = draft_ids.detach() if isinstance(draft_ids, torch.Tensor) else torch.as_tensor(draft_ids)
    if ids.numel() == 0:
        raise ValueError(f"draft_vocab ids are empty ({draft_ids!r}); a drafter needs at least one")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"draft_vocab ids must be integers, got dtype {ids.dtype}")
    if ids.dim() != 1:
        raise ValueError(f"draft_vocab ids must be a 1-D sequence, got shape {tuple(ids.shape)}")
    ids = ids.long()
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():
        raise ValueError(f"draft_vocab id {int(bad[0])} is outside the vocabulary [0, {vocab_size})")
    ids, counts = torch.unique(ids, sorted=True, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"draft_vocab id {int(ids[counts > 1][0])} is repeated")
    return ids


def most_frequent_token_ids(
    token_id_lists: Iterable[Sequence[int] | torch.Tensor],
    k: int,
    vocab_size: int,
    *,
    always_include: Sequence[int] = (),
) -> torch.Tensor:
    """The k most frequent token ids in a corpus, for a drafter's truncated vocabulary.

    Args:
        token_id_lists: tokenised documents (lists or 1-D tensors of ids).
        k: how many ids to keep, 1..vocab_size.
        vocab_size: V.
        always_include: ids kept whatever their count (EOS: a drafter that cannot propose the end
            of an answer loses every draft that crosses it).

    Returns:
        [k] long tensor of ids, sorted ascending. Ties, including unseen ids when the corpus has
        fewer than k distinct tokens, go to the lower id.

    Raises:
        ValueError: k out of range, or more forced ids than k.
    """
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab_size:
        raise ValueError(f"k={k!r} must be an int in [1, {vocab_size}]")
    forced = torch.unique(torch.as_tensor(list(always_include), dtype=torch.long))
    if forced.numel() > k:
        raise ValueError(f"always_include has {forced.numel()} ids, more than k={k}")
    if forced.numel() and (forced.min() < 0 or forced.max() >= vocab_size):
        raise ValueError(f"always_include ids {forced.tolist()} fall outside [0, {vocab_size})")

    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for ids in token_id_lists:
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if ids.numel():
            if ids.min() < 0 or ids.max() >= vocab_size:
                raise ValueError(f"corpus token id outside [0, {vocab_size}): {ids.tolist()[:8]}...")
            counts += torch.bincount(ids, minlength=vocab_size).double()
    counts[forced] = float("inf")
    # Stable sort so ties go to the lower id and the result is deterministic.
    top = torch.argsort(counts, descending=True, stable=True)[:k]
    return torch.sort(top).values


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

    Args:
        target: the target causal LM.
        num_layers: decoder layers to keep, 1..target's num_hidden_layers.
        draft_vocab: None for the full vocabulary; explicit token ids (sequence or [K] tensor);
            or an int K, meaning the K most frequent ids of `corpus` (EOS always included).
        corpus: tokenised documents, needed only when `draft_vocab` is an int.

    Returns:
        The drafter. With a truncated vocabulary its LM head is a `DraftVocabHead`,
        `config.tie_word_embeddings` is False and `config.draft_vocab_ids` lists the ids.

    Raises:
        ValueError: bad `num_layers`, bad ids, or an int `draft_vocab` without a corpus.
    """
    text_config = target.config.get_text_config()
    total = text_config.num_hidden_layers
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total:
        raise ValueError(
            f"num_layers={num_layers!r} must be an int in [1, {total}] (the target's layer count)"
        )
    draft_ids = _draft_ids_for(target, draft_vocab, corpus)

    config = copy.deepcopy(target.config)
    _trim_per_layer_config(config.get_text_config(), num_layers)
    # Built on the meta device: allocating and randomly initialising weights that are about to be
    # overwritten would cost as much as the copy itself.
    with torch.device("meta"):
        drafter = type(target)(config)
    _copy_weights(target, drafter)
    drafter.generation_config = copy.deepcopy(target.generation_config)

    if draft_ids is not None:
        _truncate_vocab(drafter, draft_ids)
    else:
        # A target that is itself a truncated drafter passes its truncation on (its config carries
        # draft_vocab_ids), so the drafter's config and head agree.
        apply_draft_vocab_from_config(drafter)
    drafter.eval()
    return drafter


def _draft_ids_for(
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
    return validate_draft_ids(draft_vocab, vocab_size)


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
            raise RuntimeError(
                f"cannot derive the drafter: target has no tensor {name!r} of shape {tuple(meta.shape)}"
            )
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


def _truncate_vocab(drafter: PreTrainedModel, draft_ids: torch.Tensor) -> None:
    """Swap the drafter's full LM head for a `DraftVocabHead` over `draft_ids` and record the ids."""
    head = drafter.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise TypeError(f"can only truncate an nn.Linear LM head, got {type(head).__name__}")
    drafter.set_output_embeddings(DraftVocabHead.from_linear(head, draft_ids))
    config = drafter.config.get_text_config()
    # The truncated head no longer mirrors the embedding matrix, so it must never be re-tied to it;
    # and the on-disk head is written in full, so a stock loader must not expect to tie either.
    config.tie_word_embeddings = False
    drafter.config.tie_word_embeddings = False
    config.draft_vocab_ids = draft_ids.tolist()
    drafter.all_tied_weights_keys = drafter.get_expanded_tied_weights_keys(all_submodels=True)


def apply_draft_vocab_from_config(model: PreTrainedModel) -> PreTrainedModel:
    """Restore a truncated-vocab drafter loaded as a plain full-vocab model.

    If `config.draft_vocab_ids` is set and the LM head is a plain `nn.Linear`, it is replaced by a
    `DraftVocabHead` built from the loaded head, whose draft rows are the trained ones: logits
    at the draft ids are unchanged, the others become `finfo.min`. A no-op otherwise.

    Returns:
        `model`, modified in place.
    """
    ids = getattr(model.config.get_text_config(), "draft_vocab_ids", None)
    if ids is None:
        return model
    head = model.get_output_embeddings()
    if isinstance(head, DraftVocabHead):
        return model
    _truncate_vocab(model, validate_draft_ids(ids, model.config.get_text_config().vocab_size))
    return model
