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

from specdecode.core.devices import autocast_context
from specdecode.models.feature_drafter import FeatureDrafter, unrolled_features


class FeatureDrafterLogits(nn.Module):
    """`steps` unrolled drafting passes of a feature drafter on standard positions.

    A module of its own so DDP wraps the whole computation (as `training.DrafterLogits`).
    """

    def __init__(self, drafter: FeatureDrafter, steps: int, autocast: torch.dtype | None = None, noise: float = 0.0) -> None:
        super().__init__()
        self.drafter = drafter
        self.steps = steps
        # mixed precision: the passes under autocast at this dtype, the outputs returned in fp32
        self.autocast = autocast
        # EAGLE's feature noise: in training mode, U(-noise, noise) is added to the target
        # features the drafter reads (not to the regression targets), so that it learns to draft
        # from features that are slightly off, as its own predicted ones are at steps 2..gamma.
        self.noise = noise

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`input_ids`, `attention_mask` `[B, T]`, target `features` `[B, T, H]` and the `[B, T]`
        bool loss `positions` (standard positions, P of them) →

        logits `[S, P, K]` over the drafter's K vocabulary ids and predicted features `[S, P, H]`
        of the S passes at those positions, in row-major order. Pass j is only meaningful from
        position j on (`pass_positions`). The head runs at the P positions only: over all B × T
        it was most of a training step (the prompt positions carry no loss).
        """
        inputs = features[:, :-1]
        if self.training and self.noise > 0:
            inputs = inputs + torch.empty_like(inputs).uniform_(-self.noise, self.noise)
        with autocast_context(input_ids.device, self.autocast):
            passes = unrolled_features(self.drafter, inputs, input_ids[:, 1:], attention_mask[:, 1:], self.steps)
            # standard position t holds the pass's output made at t - 1; position 0 has none (zero)
            predicted = torch.stack([F.pad(p, (0, 0, 1, 0))[positions] for p in passes])
            head = self.drafter.get_output_embeddings()
            logits = F.linear(predicted, head.weight, head.bias)
        return (logits, predicted) if self.autocast is None else (logits.float(), predicted.float())


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


def feature_regression_sum(predicted: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """Σ over positions of the mean over H of smooth-L1(predicted, target feature), both `[P, H]`."""
    return F.smooth_l1_loss(predicted, features.to(predicted.dtype), reduction="none").mean(-1).sum()
