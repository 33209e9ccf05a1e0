"""A router that routes by kind of prompt: a linear classifier names the prompt's domain, and the
prompt takes the drafter that pays best on that domain on average.

One prompt's labels differ between drafters mostly by what its continuation happens to be, which
its text does not predict; what does carry over is which drafter pays on a kind of prompt
(docs/experiments/2026-11-27-simulated-labels-centroid-router.md). This router learns that policy
without being told the domain:

- a multinomial logistic regression over the prompt's unit-norm embedding `[F] → [D]` domain
  probabilities, fitted (full-batch L-BFGS, deterministic) on domain-tagged training prompts: the
  labels' own plus more of each domain's training split, since they need no target pass. It names
  domains more accurately than the nearest domain centroid
  (docs/experiments/2026-11-27-domain-classifier-router.md);
- each domain's mean label per drafter (its `table` row, from the labels' train rows);
- a prompt's scores are the table row of its most probable domain. Scoring each drafter by its
  label expected under the domain probabilities instead (hedging unsure prompts towards a drafter
  that pays on both domains, often the generic one) recovered less of the oracle's gain: the
  classifier is underconfident, so it hedged prompts it had right.

It has the `Router` surface the fit report, the evaluation and `route_and_generate` use
(`drafters`, `objective`, `embedder`, `scores`, `route`, `choose`, `save`), and `Router.load` reads
it back (router.json's `kind`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save

from specdecode.core.atomic import write_atomic
from specdecode.routing.choice import ArgmaxRouting
from specdecode.routing.embedders import Embedder

KIND = "domain"


@dataclass
class DomainRouter(ArgmaxRouting):
    """`weight` `[F, D]` and `bias` `[D]` of the domain classifier over the `domains`; `table`
    `[D, K]` each domain's mean objective per drafter (in `drafters` order)."""

    embedder: Embedder
    drafters: list[str]
    domains: list[str]
    weight: torch.Tensor
    bias: torch.Tensor
    table: torch.Tensor
    objective: str = "speedup"
    embedder_spec: dict[str, Any] | None = None

    @classmethod
    def fit(
        cls,
        embeddings: torch.Tensor,
        domains: Sequence[str],
        targets: torch.Tensor,
        target_domains: Sequence[str],
        drafters: Sequence[str],
        embedder: Embedder,
        *,
        l2: float = 1e-4,
        objective: str = "speedup",
        embedder_spec: dict[str, Any] | None = None,
    ) -> DomainRouter:
        """The classifier from `[M, F]` embeddings of M prompts tagged with their `domains`; the
        table from `[N, K]` labels `targets` of N prompts tagged with `target_domains`. `l2` weighs
        the classifier's squared weights against its mean cross-entropy."""
        if embeddings.dim() != 2 or embeddings.shape[0] != len(domains) or embeddings.shape[0] < 1:
            raise ValueError(f"need [M, F] embeddings and M domains, got {tuple(embeddings.shape)} and {len(domains)}")
        if targets.dim() != 2 or targets.shape[0] != len(target_domains) or targets.shape[1] != len(drafters):
            raise ValueError(
                f"need [N, K] targets, N target domains and K drafters, got {tuple(targets.shape)}, "
                f"{len(target_domains)} and {len(drafters)}"
            )
        names = sorted(set(target_domains))
        unknown = sorted(set(domains) - set(names))
        if unknown:
            raise ValueError(f"prompts of domains {unknown} have no labels to route them by (labelled: {names})")
        if len(names) < 2:
            raise ValueError(f"need labels of at least 2 domains to route between, got {names}")
        table = torch.stack(
            [targets[torch.tensor([d == name for d in target_domains])].float().mean(0) for name in names]
        )
        classes = torch.tensor([names.index(d) for d in domains])
        weight, bias = _logistic_regression(_unit(embeddings), classes, len(names), l2)
        return cls(embedder, list(drafters), names, weight, bias, table, objective, embedder_spec)

    def probabilities(self, texts: Sequence[str]) -> torch.Tensor:
        """`[N, D]` the classifier's probability of each domain, per text."""
        return (_unit(self.embedder.encode(list(texts))) @ self.weight + self.bias).softmax(dim=-1)

    def most_probable(self, texts: Sequence[str]) -> torch.Tensor:
        """`[N]` index (into `domains`) of each text's most probable domain."""
        return self.probabilities(texts).argmax(dim=1)

    def domain_of(self, texts: Sequence[str]) -> list[str]:
        """The most probable domain of each text."""
        return [self.domains[i] for i in self.most_probable(texts).tolist()]

    def scores(self, texts: Sequence[str]) -> torch.Tensor:
        """`[N, K]` each drafter's mean objective on the text's most probable domain."""
        return self.table[self.most_probable(texts)]

    def save(self, directory: str | Path) -> Path:
        """Write `router.safetensors` and `router.json` into `directory`, each atomically."""
        directory = Path(directory)
        tensors = {"weight": self.weight.contiguous(), "bias": self.bias.contiguous(), "table": self.table.contiguous()}
        write_atomic(directory / "router.safetensors", save(tensors))
        config = {
            "kind": KIND,
            "drafters": self.drafters,
            "domains": self.domains,
            "embedder": self.embedder_spec,
            "objective": self.objective,
        }
        write_atomic(directory / "router.json", json.dumps(config, indent=2))
        return directory

    @classmethod
    def load_saved(cls, directory: Path, config: dict[str, Any], embedder: Embedder) -> DomainRouter:
        """The router `save` wrote to `directory` (router.json already read into `config`)."""
        tensors = load_file(directory / "router.safetensors")
        return cls(
            embedder,
            list(config["drafters"]),
            list(config["domains"]),
            tensors["weight"],
            tensors["bias"],
            tensors["table"],
            config["objective"],
            config["embedder"],
        )


def _unit(embeddings: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(embeddings.float(), dim=-1)


def _logistic_regression(
    x: torch.Tensor, classes: torch.Tensor, num_classes: int, l2: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[F, C]` weight and `[C]` bias minimising mean cross-entropy + `l2`·|weight|² over `[M, F]`
    `x` and `[M]` `classes`: convex, so full-batch L-BFGS from zeros lands on the same optimum every
    run (no seed, no validation split to hold back)."""
    weight = torch.zeros(x.shape[1], num_classes, requires_grad=True)
    bias = torch.zeros(num_classes, requires_grad=True)
    optimizer = torch.optim.LBFGS(
        [weight, bias], max_iter=500, tolerance_grad=1e-9, tolerance_change=1e-12, line_search_fn="strong_wolfe"
    )

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ weight + bias, classes) + l2 * weight.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return weight.detach(), bias.detach()
