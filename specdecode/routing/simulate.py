"""Greedy speculative decoding of a known continuation y, simulated from teacher-forced passes.
Greedy output is y whichever drafter runs, and draft j of a pass only counts when drafts 1..j-1
matched, when what it read is what teacher forcing gives. So one forward per drafting step gives
match[j, i] = 1[draft j of the pass whose first draft predicts y_i equals y_{i+j-1}], and from it
the tokens per pass (tau) the evaluation's oracle ranks drafters by.
"""

from __future__ import annotations

import torch

from specdecode.decoding.lookup import PromptLookup, lookup_logits
from specdecode.models.feature_drafter import FeatureDrafter
from specdecode.training.feature_training import unrolled_features


def draft_matches(
    drafter: torch.nn.Module,
    tokens: torch.Tensor,
    attention: torch.Tensor,
    keep: torch.Tensor,
    p_argmax: torch.Tensor,
    gamma: int,
    *,
    features: torch.Tensor | None = None,
    first_logits: torch.Tensor | None = None,
    lookup: PromptLookup | None = None,
) -> torch.Tensor:
    """`[B, gamma, C]` bool: whether draft j of a pass whose first draft predicts continuation
    position c equals the target's greedy token there (`match[b, j - 1, c]`). tokens, attention:
    `[B, S]` packed as `labels._pack`; keep: `[C]`; p_argmax: `[B, C]`; features: `[B, S, n·H]` (a
    `FeatureDrafter`'s); first_logits: `[B, C, V]` a slice drafter's logits at `keep`."""
    if not isinstance(drafter, FeatureDrafter):
        if first_logits is None:
            raise ValueError("a slice drafter's matches need its teacher-forced first_logits")
        if lookup is not None:
            first_logits = lookup_logits(first_logits, tokens, attention, keep, lookup)
        return (first_logits.argmax(-1) == p_argmax).unsqueeze(1).expand(-1, gamma, -1)
    if features is None:
        raise ValueError("a feature drafter's matches need the target's features")
    # Drafter position t predicts x_{t+2}: only the continuation's, at keep - 1, need passes 2..gamma.
    needed = torch.zeros_like(attention[:, :-1], dtype=torch.bool)
    needed[:, keep - 1] = True
    passes = unrolled_features(drafter, features[:, :-1], tokens[:, 1:], attention[:, :-1], gamma, needed=needed)
    matches = []
    for hidden in passes:
        logits = drafter.logits(hidden[:, keep - 1])
        if lookup is not None:
            logits = lookup_logits(logits, tokens, attention, keep, lookup)
        matches.append(logits.argmax(-1) == p_argmax)
    return torch.stack(matches, dim=1)


def target_calls(matches: torch.Tensor, length: int) -> int:
    """Target calls (the prefill and one per pass) greedy decoding needs for the first `length`
    tokens of a continuation, from one row's `[gamma, C]` `draft_matches`."""
    gamma = matches.shape[0]
    # leading[i]: how many drafts in a row match for a pass whose first draft predicts token i
    table = matches.tolist()
    calls, committed = 1, 1  # the prefill commits y_0
    while committed < length:
        start = committed
        accepted = 0
        while accepted < gamma and start + accepted < length and table[accepted][start + accepted]:
            accepted += 1
        committed += accepted + 1
        calls += 1
    return calls


def simulated_tau(matches: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """`[B]` tokens per target call of greedy decoding, from `[B, gamma, C]` `draft_matches` and
    `[B]` continuation lengths."""
    cpu = matches.cpu()
    return torch.tensor([int(n) / target_calls(cpu[b], int(n)) for b, n in enumerate(lengths.tolist())])
