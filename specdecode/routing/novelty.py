"""Prompts far from every trained domain: the router's MLP names one of its domains for any text,
so a prompt unlike all of them would take the nearest domain's drafter on no evidence. `Novelty`
measures a prompt's distance to each domain's centroid and sends a prompt beyond every domain's
threshold to a fallback route instead (the generic drafter by default, or plain decoding).

    distance_d(x) = 1 − cos(x, c_d),   far(x) = distance_d(x) > threshold_d for every domain d

c_d is the mean unit-length feature of domain d's prompts the MLP learnt from; threshold_d is the
`quantile` of the distances of held-out prompts of domain d (prompts the router never saw) to c_d,
so about 1 − quantile of a domain's own new prompts lie past its threshold, and fewer past all of
them. Sentence embeddings are compared by angle; a per-domain threshold lets a broad domain (chat)
keep its spread without widening a narrow one's (code).
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
    """centroids: `[D, F]` each domain's mean unit-length feature, unit length, in the router's
    domain order; thresholds: `[D]` each domain's `quantile` of held-out in-domain distances;
    fallback: where a prompt beyond every threshold goes (`AUTOREGRESSIVE` or a drafter's name)."""

    centroids: torch.Tensor
    thresholds: torch.Tensor
    fallback: str
    quantile: float

    def distances(self, features: torch.Tensor) -> torch.Tensor:
        """Raw features `[N, F]` → `[N, D]` cosine distance to each domain's centroid (a zero
        feature vector is at distance 1 from every domain)."""
        return 1.0 - torch.nn.functional.normalize(features.float(), dim=1) @ self.centroids.T

    def is_far(self, features: torch.Tensor) -> torch.Tensor:
        """`[N]` bool: the prompt lies beyond every domain's threshold."""
        return (self.distances(features) > self.thresholds).all(dim=1)


def fallback_route(fallback: str, drafters: Sequence[str], no_drafter: str) -> str:
    """The router's drafter name `fallback` stands for: `no_drafter` for `AUTOREGRESSIVE`, else itself.

    Raises ValueError: naming `fallback` and what it may be: autoregressive (where `drafters` hold
    `no_drafter`, the plain-decoding route) or one of `drafters`.
    """
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
    """Each domain's centroid from `features` `[M, F]` (of the M prompts the MLP learnt from, by
    `domains`) and its threshold from `heldout` `[H, F]` (prompts it never saw, by
    `heldout_domains`); `names` are the D domains in the router's order.

    Raises ValueError: `quantile` outside (0, 1]; a domain of `names` with no prompt in `domains` or
    none in `heldout_domains`; features of different widths.
    """
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
