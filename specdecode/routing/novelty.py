"""Prompts far from every trained domain go to a fallback route, not to the nearest domain's
drafter: far(x) = (1 − cos(x, c_d) > threshold_d for every domain d), with c_d the mean unit
feature of d's training prompts and threshold_d a `quantile` of the distances of d's prompts the
router never saw (per domain, so a broad domain keeps its spread without widening a narrow one's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode.core.config import is_number

# The route name of plain decoding in a fallback setting (the router's own name for it is NO_DRAFTER).
AUTOREGRESSIVE = "autoregressive"


@dataclass(eq=False)
class Novelty:
    """centroids: `[D, F]` unit, in the router's domain order; thresholds: `[D]`; fallback: where a
    prompt beyond every threshold goes (`AUTOREGRESSIVE` or a drafter's name)."""

    centroids: torch.Tensor
    thresholds: torch.Tensor
    fallback: str
    quantile: float

    def distances(self, features: torch.Tensor) -> torch.Tensor:
        """Raw features `[N, F]` → `[N, D]` cosine distance to each domain's centroid."""
        return 1.0 - torch.nn.functional.normalize(features.float(), dim=1) @ self.centroids.T

    def is_far(self, features: torch.Tensor) -> torch.Tensor:
        """`[N]` bool: the prompt lies beyond every domain's threshold."""
        return (self.distances(features) > self.thresholds).all(dim=1)


def fallback_route(fallback: str, drafters: Sequence[str], no_drafter: str) -> str:
    """The router's drafter name `fallback` stands for: `no_drafter` for `AUTOREGRESSIVE`, else itself;
    a ValueError naming it and what it may be where it is no route."""
    route = no_drafter if fallback == AUTOREGRESSIVE else fallback
    if route not in drafters:
        allowed = [AUTOREGRESSIVE] if no_drafter in drafters else []
        allowed += [d for d in drafters if d != no_drafter]
        hint = "" if no_drafter in drafters else f" (autoregressive needs the {no_drafter!r} route: no_drafter=true)"
        raise ValueError(f"fallback={fallback!r}: expected one of {allowed}{hint}")
    return route


def fit_novelty(
    features: torch.Tensor,
    domains: Sequence[str],
    heldout: torch.Tensor,
    heldout_domains: Sequence[str],
    names: Sequence[str],
    *,
    quantile: float = 0.99,
    fallback: str = "generic",
) -> Novelty:
    """Each of the D domains `names`' centroid from `features` `[M, F]` (by `domains`) and threshold
    from `heldout` `[H, F]` (by `heldout_domains`). A ValueError for a bad `quantile`, a domain
    without prompts on either side, or features of different widths."""
    if not (is_number(quantile) and 0 < quantile <= 1):
        raise ValueError(f"novelty_quantile={quantile!r}: expected a number in (0, 1]")
    if features.shape[1:] != heldout.shape[1:] or features.dim() != 2:
        raise ValueError(f"need [M, F] and [H, F] features, got {tuple(features.shape)} and {tuple(heldout.shape)}")
    units = torch.nn.functional.normalize(features.float(), dim=1)
    masks = []
    for name in names:
        own = torch.tensor([d == name for d in domains], dtype=torch.bool)
        held = torch.tensor([d == name for d in heldout_domains], dtype=torch.bool)
        if not own.any() or not held.any():
            which = "fitting" if not own.any() else "held-out"
            raise ValueError(f"domain {name!r} has no {which} prompts to fit its far-prompt threshold on")
        masks.append((own, held))
    centroids = torch.stack([torch.nn.functional.normalize(units[own].mean(0), dim=0) for own, _ in masks])
    distances = 1.0 - torch.nn.functional.normalize(heldout.float(), dim=1) @ centroids.T  # [H, D]
    thresholds = torch.stack([torch.quantile(distances[held, k], quantile) for k, (_, held) in enumerate(masks)])
    return Novelty(centroids, thresholds, fallback, float(quantile))
