"""Training pieces of feature drafters. A feature drafter predicts x_{t+1} at position t - 1;
`FeatureDrafterLogits` shifts its outputs onto the positions t a slice drafter uses, so masks,
teacher logits and held-out targets are shared. `unrolled_features` runs drafting steps 2..gamma
on the drafter's own features, as decoding does (EAGLE-3's training-time test), in one forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from specdecode.core.devices import autocast_context
from specdecode.models.eagle3_drafter import Eagle3Drafter
from specdecode.models.feature_drafter import FeatureDrafter, feed_back


class FeatureDrafterLogits(nn.Module):
    """`steps` unrolled drafting passes of a feature drafter on standard positions (a module, so DDP wraps it)."""

    def __init__(
        self, drafter: FeatureDrafter, steps: int, autocast: torch.dtype | None = None, noise: float = 0.0
    ) -> None:
        super().__init__()
        self.drafter = drafter
        self.steps = steps
        # mixed precision: the passes under autocast at this dtype, the outputs returned in fp32
        self.autocast = autocast
        # EAGLE's noise U(-noise, noise) on the features read in training (not the targets): its own are off too
        self.noise = noise

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`input_ids`, `attention_mask` `[B, T]`, target `features` `[B, T, n·H]` and the P loss
        `positions` `[B, T]` → logits `[S, P, K]` and predicted features `[S, P, H]` of the S passes
        there (pass j meaningful from position j on). The head runs at the P positions only.
        """
        inputs = features[:, :-1]
        if self.training and self.noise > 0:
            inputs = inputs + torch.empty_like(inputs).uniform_(-self.noise, self.noise)
        inputs = self.drafter.input_features(inputs)
        with autocast_context(input_ids.device, self.autocast):
            # drafter position t makes the prediction scored at standard position t + 1
            passes = unrolled_features(
                self.drafter, inputs, input_ids[:, 1:], attention_mask[:, 1:], self.steps, needed=positions[:, 1:]
            )
            # standard position t holds the pass's output made at t - 1; position 0 has none (zero)
            predicted = torch.stack([F.pad(p, (0, 0, 1, 0))[positions] for p in passes])
            logits = self.drafter.draft_logits(predicted)
        return (logits, predicted) if self.autocast is None else (logits.float(), predicted.float())


def regression_weight(configured: float | None, drafter: FeatureDrafter) -> float:
    """The weight of the feature regression: `train.feature_loss_weight` (null: 1), 0 for an EAGLE-3
    drafter (its outputs are its own states), where a positive one is a ValueError."""
    if not isinstance(drafter, Eagle3Drafter):
        return 1.0 if configured is None else float(configured)
    if configured:
        raise ValueError(
            f"train.feature_loss_weight={configured}: an EAGLE-3 drafter's outputs are its own states, "
            "not the target's features; use null or 0"
        )
    return 0.0


def pass_positions(positions: torch.Tensor, steps: int) -> torch.Tensor:
    """`[S, B, T]` loss positions of each pass: pass j (1-based) counts from position j on."""
    t = torch.arange(positions.shape[1], device=positions.device)
    return torch.stack([positions & (t >= j) for j in range(1, steps + 1)])


def frozen_head_rows(target_head: nn.Module, draft_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's LM-head rows (and bias) at the draft ids, detached: the teacher's logits are
    `features @ weight.T + bias` (the drafter's own head may train)."""
    head_weight: torch.Tensor = target_head.weight  # type: ignore[assignment]  # an nn.Linear's, typed Tensor | Module
    head_bias: torch.Tensor | None = getattr(target_head, "bias", None)
    weight = head_weight.detach()[draft_ids.to(head_weight.device)].clone()
    bias = None if head_bias is None else head_bias.detach()[draft_ids].clone()
    return weight, bias


def feature_regression_sum(predicted: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """Σ over positions of the mean over H of smooth-L1(predicted, target feature), both `[P, H]`."""
    return F.smooth_l1_loss(predicted, features.to(predicted.dtype), reduction="none").mean(-1).sum()


def unrolled_features(
    drafter: nn.Module,
    features: torch.Tensor,
    next_ids: torch.Tensor,
    padding: torch.Tensor,
    steps: int,
    needed: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Predicted features of `steps` drafting passes, each `[B, T, H]`, as decoding runs them: pass 1
    reads the true `features` `[B, T, n·H]` (f_t with x_{t+1} = `next_ids[:, t]`), pass j pass j-1's
    prediction (`feed_back`). Passes 2..steps run only on a window around the `needed` `[B, T]`
    positions (None: all; `_unrolled_windows`) and are zero elsewhere; pass 1 runs everywhere.
    """
    batch, length, _ = features.shape
    if needed is None:
        needed = torch.ones(batch, length, dtype=torch.bool, device=features.device)
    positions = torch.arange(length, device=features.device).expand(batch, -1)
    cache = DynamicCache()
    hidden = drafter(features, next_ids, attention_mask=padding, position_ids=positions, past_key_values=cache)
    outputs = [hidden]
    if steps == 1:
        return outputs
    index = _unrolled_windows(needed, steps)  # [B, W]
    gather = index.unsqueeze(-1)
    window_ids = next_ids.gather(1, index)
    for j in range(2, steps + 1):
        # position t reads the previous pass's prediction made at t - 1; position 0 has none and
        # is never scored, so it reads its true feature
        previous = torch.cat([features[:, :1], feed_back(outputs[-1][:, :-1], features.shape[-1])], dim=1)
        fed = previous.gather(1, gather.expand(-1, -1, previous.shape[-1]))
        mask = _window_mask(index, j, padding, length, hidden.dtype)
        window = drafter(fed, window_ids, attention_mask=mask, position_ids=index, past_key_values=cache)  # [B, W, H]
        outputs.append(
            window.new_zeros(batch, length, window.shape[-1]).scatter(
                1, gather.expand(-1, -1, window.shape[-1]), window
            )
        )
    return outputs


def _unrolled_windows(needed: torch.Tensor, steps: int) -> torch.Tensor:
    """`[B, W]` positions that passes 2..steps run at: per row, consecutive positions covering its
    `needed` ones and the steps - 2 before the first (a pass-`steps` query reaches back that far
    into pass 2), one width W for the batch, shifted left where a row would run past its end."""
    batch, length = needed.shape
    t = torch.arange(length, device=needed.device)
    any_needed = needed.any(dim=1)
    first = torch.where(needed, t, length).min(dim=1).values
    last = torch.where(needed, t, -1).max(dim=1).values
    start = (first - (steps - 2)).clamp_min(0)
    span = torch.where(any_needed, last - start + 1, 1)
    width = min(int(span.max()), length)  # one host sync per batch
    start = torch.where(any_needed, start, 0).clamp_max(length - width)
    return start.unsqueeze(1) + torch.arange(width, device=needed.device)


def _window_mask(index: torch.Tensor, j: int, padding: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask `[B, 1, W, T + (j - 1)W]` of pass j's window queries over the cached keys:
    pass 1's T keys, then each earlier window pass's W keys and its own.

    Pass j (1-based) at position s stands for the j-th drafting step made at s. Decoding, that
    query sees the cache of true-feature entries up to s - j + 1 and the entries that steps 2..j
    wrote at s - j + 2 .. s; so pass-1 keys at positions <= s - j + 1 and the pass-i key at
    s - j + i (2 <= i <= j). `padding` `[B, T]` (1 = token) hides padded keys."""
    s = index.unsqueeze(-1)  # [B, W, 1]
    keys = padding.bool()
    first = (torch.arange(length, device=index.device).view(1, 1, -1) <= s - j + 1) & keys.unsqueeze(1)
    window_keys = keys.gather(1, index).unsqueeze(1)  # [B, 1, W]
    later = [(index.unsqueeze(1) == s - j + i) & window_keys for i in range(2, j + 1)]
    visible = torch.cat([first, *later], dim=-1)
    # a query with nothing visible (a window edge no needed output reads) sees its own key
    own = torch.zeros_like(visible)
    own[..., -index.shape[1] :] = torch.eye(index.shape[1], dtype=torch.bool, device=index.device)
    visible = visible | (own & ~visible.any(dim=-1, keepdim=True))
    mask = torch.zeros(visible.shape, dtype=dtype, device=index.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min).unsqueeze(1)
