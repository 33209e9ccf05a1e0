"""Truncated vocabularies: a drafter head that scores only K chosen ids, the corpora's most
frequent (SmolLM2's 49,152 x 576 head is ~28M of its 135M parameters). On disk a plain full-vocab
checkpoint plus `config.draft_vocab_ids`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from specdecode.models.compat import Configured
from specdecode.models.cpu_matmul import skinny_linear


class DraftVocabHead(nn.Module):
    """An LM head that scores only K draft token ids but returns full-vocabulary logits `[.., V]`,
    `finfo(dtype).min` (not -inf: log-probabilities stay finite) at the other ids. `state_dict()`
    reports `weight` as the full [V, H] matrix and `load_state_dict()` takes it back, so checkpoints
    stay plain. `weight` [K, H] / `bias` [K]: the trained rows at the sorted `draft_ids` [K];
    `base_weight` [V, H] / `base_bias` [V]: the frozen full head; `skinny_rows`: `use_skinny_linears`'.
    """

    skinny_rows: tuple[int, int] | None = None
    # buffers (register_buffer), declared for the type checker
    draft_ids: torch.Tensor
    base_weight: torch.Tensor
    base_bias: torch.Tensor | None

    def __init__(
        self, full_weight: torch.Tensor, draft_ids: torch.Tensor, full_bias: torch.Tensor | None = None
    ) -> None:
        """From a full head `full_weight` [V, H] (copied) and `full_bias` [V] or None."""
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
        return self.base_weight.index_copy(0, self.draft_ids, self.weight.detach())

    def full_bias(self) -> torch.Tensor | None:
        """[V] counterpart of `full_weight` for the bias, or None."""
        if self.bias is None or self.base_bias is None:
            return None
        return self.base_bias.index_copy(0, self.draft_ids, self.bias.detach())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, H] final hidden states → [B, T, V] logits: `hidden @ weight.T (+ bias)` at
        `draft_ids`, `finfo.min` elsewhere."""
        draft_logits = self.draft_logits(hidden)
        return self.spread(draft_logits, torch.finfo(draft_logits.dtype).min)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[..., H]` → `[..., K]`: the logits of the draft ids only, in `draft_ids` order."""
        if self.skinny_rows is not None:  # the CPU kernel the model's linears use (models.cpu_matmul)
            return skinny_linear(hidden, self.weight, self.bias, self.skinny_rows)
        return F.linear(hidden, self.weight, self.bias)

    def spread(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """`[..., K]` values of the draft ids → `[..., V]`, `fill` at every other id."""
        return values.new_full((*values.shape[:-1], self.vocab_size), fill).index_copy(-1, self.draft_ids, values)

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
    """Accept the full [V, H] head as the base, its draft rows into `weight`; other shapes are torch's to report."""
    for name, base_name in (("weight", "base_weight"), ("bias", "base_bias")):
        key = prefix + name
        full = state_dict.get(key)
        base = getattr(module, base_name)
        if full is None or base is None or full.shape != base.shape:
            continue
        with torch.no_grad():
            base.copy_(full)
        state_dict[key] = full[module.draft_ids.to(full.device)]


def draft_vocab_ids(drafter: PreTrainedModel | Configured) -> torch.Tensor:
    """[K] ids the drafter's head scores: its draft ids, or all V for a full head."""
    head = drafter.get_output_embeddings()
    if isinstance(head, DraftVocabHead):
        return head.draft_ids.cpu()
    return torch.arange(drafter.config.get_text_config().vocab_size)


def validate_draft_ids(draft_ids: Sequence[int] | torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft token ids as a sorted [K] long tensor; a ValueError names an empty, non-integer, non-1-D,
    out-of-range or repeated value."""
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
    """The k most frequent token ids of tokenised documents, `[k]` sorted, ties to the lower id;
    `always_include` ids (EOS: a drafter that cannot propose the end loses every draft across it)
    are kept whatever their count. A ValueError for k outside 1..vocab_size or more forced ids than k.
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


def truncate_vocab(drafter: PreTrainedModel, draft_ids: torch.Tensor) -> None:
    """Swap the drafter's full LM head for a `DraftVocabHead` over `draft_ids` and record the ids."""
    head = drafter.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise TypeError(f"can only truncate an nn.Linear LM head, got {type(head).__name__}")
    drafter.set_output_embeddings(DraftVocabHead.from_linear(head, draft_ids))
    config = drafter.config.get_text_config()
    # never re-tied to the embeddings, here or by a stock loader of the full on-disk head
    config.tie_word_embeddings = False
    drafter.config.tie_word_embeddings = False
    config.draft_vocab_ids = draft_ids.tolist()
    drafter.all_tied_weights_keys = drafter.get_expanded_tied_weights_keys(all_submodels=True)


def pad_vocab(drafter: PreTrainedModel, vocab_size: int) -> PreTrainedModel:
    """Grow a drafter whose embeddings are padded less than the target's (Qwen2.5-0.5B: 151,936
    rows, the 7B: 152,064) to `vocab_size`: its head becomes a `DraftVocabHead` over its own ids, so
    q is exactly 0 at the padding ids. ValueError: the drafter's vocabulary is the larger; TypeError:
    the head is not an `nn.Linear`."""
    own = drafter.config.get_text_config().vocab_size
    if own == vocab_size:
        return drafter
    if own > vocab_size:
        raise ValueError(
            f"the drafter's vocabulary ({own} ids) is larger than the target's ({vocab_size}): "
            "it could propose ids the target has no probability for"
        )
    head = drafter.get_output_embeddings()
    if not isinstance(head, nn.Linear):  # (a skinny-kernel head is one)
        raise TypeError(f"can only pad a drafter with an nn.Linear LM head, got {type(head).__name__}")
    drafter.resize_token_embeddings(vocab_size, mean_resizing=False)
    truncate_vocab(drafter, torch.arange(own, device=drafter.get_output_embeddings().weight.device))
    return drafter


def apply_draft_vocab_from_config(model: PreTrainedModel) -> PreTrainedModel:
    """Restore, in place, the `DraftVocabHead` of a truncated drafter loaded as a plain full-vocab
    model (`config.draft_vocab_ids` set); a no-op otherwise. Returns `model`."""
    ids = getattr(model.config.get_text_config(), "draft_vocab_ids", None)
    if ids is None:
        return model
    if isinstance(model.get_output_embeddings(), DraftVocabHead):
        return model
    truncate_vocab(model, validate_draft_ids(ids, model.config.get_text_config().vocab_size))
    return model
