"""Greedy speculative decoding of a known continuation, simulated from one teacher-forced pass.

Under greedy decoding the output is the target's greedy continuation y, whichever drafter runs
(exactness), so how many target passes a drafter needs for y is fixed by which of its drafts match
y. A pass that starts after the committed token y_i drafts y_{i+1}, ..., y_{i+gamma}; its j-th
draft only counts when drafts 1..j-1 matched, and then everything it read is what teacher forcing
gives: the committed tokens are y, the tokens fed back are y, and a feature drafter's features are
the target's up to y_i and its own predictions after (steps 2..gamma). `unrolled_features` runs
exactly those passes, all positions at once (the attention pattern decoding sees), so

    match[j, i] = 1[draft j of a pass whose first draft predicts y_i equals y_{i+j-1}]

comes out of one forward per drafting step, and the passes are counted from it:
the prefill gives y_0, a pass starting at y_i commits its leading matching drafts L (at most gamma)
and the target's own next token, and the next pass starts at y_{i+L+1}.

These are the tokens per target pass (tau) the evaluation's oracle ranks drafters by
(`specdecode.evaluation.records.pick_per_prompt`), where the teacher-forced greedy match counts
only first drafts (a feature drafter's later ones read its own features and match less often).
A slice drafter reads tokens only, so its j-th draft at a position is its first one there.
Prompt lookup is applied as decoding applies it, draft by draft (`lookup_logits`).
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
    """`[B, gamma, C]` bool: `match[b, j - 1, c]`, draft j of a pass whose first draft predicts the
    token at continuation position c, equals the target's greedy token there.

    Args:
        drafter: a `FeatureDrafter` (needs `features`) or a slice drafter (needs `first_logits`).
        tokens, attention: `[B, S]` left-padded prompt + right-padded continuation (`_pack`).
        keep: `[C]` the columns whose predictions are the continuation (column t predicts t + 1).
        p_argmax: `[B, C]` the target's greedy tokens there (the continuation itself).
        gamma: drafts per pass.
        features: `[B, S, n·H]` the target's features the drafter reads (`target_features`).
        first_logits: `[B, C, V]` a slice drafter's teacher-forced logits at `keep`.
        lookup: prompt lookup beside the drafter, or None.
    """
    if not isinstance(drafter, FeatureDrafter):
        if first_logits is None:
            raise ValueError("a slice drafter's matches need its teacher-forced first_logits")
        if lookup is not None:
            first_logits = lookup_logits(first_logits, tokens, attention, keep, lookup)
        return (first_logits.argmax(-1) == p_argmax).unsqueeze(1).expand(-1, gamma, -1)
    if features is None:
        raise ValueError("a feature drafter's matches need the target's features")
    # Drafter position t reads (f_t, x_{t+1}) and predicts x_{t+2}: the continuation's predictions
    # are at keep - 1, and only those positions (plus what they read) need passes 2..gamma.
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
