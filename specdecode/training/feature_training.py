"""Training pieces specific to feature drafters (specdecode.models.feature_drafter), used by specdecode.training.job.

Alignment. The training loop scores "standard" positions t: the prediction of x_{t+1} (a slice
drafter's logits at t). A feature drafter makes that prediction at its position t - 1, from the
target feature f_{t-1} and the token x_t; its output there estimates f_t, the feature the target's
head turns into p(x_{t+1}). `FeatureDrafterLogits` returns its outputs shifted onto the standard
positions, so masks, teacher logits and held-out targets are shared with slice drafters; the
teacher's logits at t are the frozen head applied to f_t, its regression target is f_t itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.models.feature_drafter import FeatureDrafter, unrolled_features


class FeatureDrafterLogits(nn.Module):
    """`steps` unrolled drafting passes of a feature drafter on standard positions.

    A module of its own so DDP wraps the whole computation (as `training.DrafterLogits`).
    """

    def __init__(self, drafter: FeatureDrafter, steps: int) -> None:
        super().__init__()
        self.drafter = drafter
        self.steps = steps

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`input_ids`, `attention_mask` `[B, T]`, target `features` `[B, T, H]` →

        logits `[S, B, T, K]` over the drafter's K vocabulary ids and predicted features
        `[S, B, T, H]` for the S passes, on standard positions (position 0 is zero: nothing
        predicts x_1 there). Pass j is only meaningful from position j on.
        """
        passes = unrolled_features(self.drafter, features[:, :-1], input_ids[:, 1:], attention_mask[:, 1:], self.steps)
        predicted = torch.stack([F.pad(p, (0, 0, 1, 0)) for p in passes])
        head = self.drafter.get_output_embeddings()
        logits = F.linear(predicted, head.weight, head.bias)
        return logits, predicted


def pass_positions(positions: torch.Tensor, steps: int) -> torch.Tensor:
    """`[S, B, T]` loss positions of each pass: pass j (1-based) counts from position j on."""
    t = torch.arange(positions.shape[1], device=positions.device)
    return torch.stack([positions & (t >= j) for j in range(1, steps + 1)])


def frozen_head_rows(target_head: nn.Module, draft_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's LM-head rows (and bias) at the draft ids, detached: the teacher's logits over
    the draft vocabulary are `features @ weight.T + bias` (the drafter's own head may train)."""
    weight = target_head.weight.detach()[draft_ids.to(target_head.weight.device)].clone()
    bias = None if getattr(target_head, "bias", None) is None else target_head.bias.detach()[draft_ids].clone()
    return weight, bias


def feature_regression_sum(predicted: torch.Tensor, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Σ over counted positions of the mean over H of smooth-L1(predicted, target feature)."""
    per_token = F.smooth_l1_loss(predicted, features.to(predicted.dtype), reduction="none").mean(-1)
    return per_token[positions].sum()
