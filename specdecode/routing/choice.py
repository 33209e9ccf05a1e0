"""What every router does with its scores: the drafter with the highest one, per text."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ArgmaxRouting:
    """`route` / `choose` for a router with `drafters` (K names) and `scores(texts)` → `[N, K]`."""

    drafters: list[str]

    def scores(self, texts: Sequence[str]) -> torch.Tensor:
        raise NotImplementedError

    def route(self, texts: Sequence[str]) -> list[int]:
        """Index into `drafters` of the chosen drafter per text."""
        if not texts:
            raise ValueError("texts is empty: nothing to route")
        return self.scores(texts).argmax(dim=1).tolist()

    def choose(self, texts: Sequence[str]) -> list[str]:
        """Name of the chosen drafter per text."""
        return [self.drafters[i] for i in self.route(texts)]
