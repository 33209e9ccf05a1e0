"""A router that routes by kind of prompt: the nearest domain centroid's best drafter.

One prompt's labels differ between drafters mostly by what its continuation happens to be, which
its text does not predict; what does carry over is which drafter pays on a kind of prompt. On the
2026-11-27 demo's drafters, routing every held-out prompt to its own domain's specialist recovered
73% of the per-prompt oracle's gain over the best single drafter in real decodes (16 prompts per
domain), the MLP router fitted to per-prompt labels 22% (docs/results.md, "Router labels from
simulated decoding"). This router learns that policy without being told the domain: the mean
normalised embedding of each domain's training prompts (its centroid) and the domain's mean label
per drafter (its table); a prompt takes the table row of the centroid nearest it (cosine).

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

KIND = "centroid"


@dataclass
class CentroidRouter(ArgmaxRouting):
    """`centroids` `[D, F]` unit vectors of the `domains`; `table` `[D, K]` each domain's mean
    objective per drafter (in `drafters` order) over its training prompts."""

    embedder: Embedder
    drafters: list[str]
    domains: list[str]
    centroids: torch.Tensor
    table: torch.Tensor
    objective: str = "speedup"
    embedder_spec: dict[str, Any] | None = None

    @classmethod
    def fit(
        cls, embeddings: torch.Tensor, targets: torch.Tensor, domains: Sequence[str], drafters: Sequence[str], embedder: Embedder,
        *, objective: str = "speedup", embedder_spec: dict[str, Any] | None = None,
    ) -> CentroidRouter:
        """From `[N, F]` embeddings, `[N, K]` targets and the N prompts' domains."""
        if embeddings.dim() != 2 or targets.dim() != 2 or not embeddings.shape[0] == targets.shape[0] == len(domains) >= 1:
            raise ValueError(f"need [N, F] embeddings, [N, K] targets and N domains, got {tuple(embeddings.shape)}, "
                             f"{tuple(targets.shape)} and {len(domains)}")
        names = sorted(set(domains))
        unit = torch.nn.functional.normalize(embeddings.float(), dim=-1)
        rows = [torch.tensor([d == name for d in domains]) for name in names]
        centroids = torch.nn.functional.normalize(torch.stack([unit[r].mean(0) for r in rows]), dim=-1)
        table = torch.stack([targets[r].float().mean(0) for r in rows])
        return cls(embedder, list(drafters), names, centroids, table, objective, embedder_spec)

    def nearest(self, texts: Sequence[str]) -> list[str]:
        """The domain whose centroid is nearest each text."""
        return [self.domains[i] for i in self._nearest(texts).tolist()]

    def _nearest(self, texts: Sequence[str]) -> torch.Tensor:
        unit = torch.nn.functional.normalize(self.embedder.encode(list(texts)).float(), dim=-1)
        return (unit @ self.centroids.T).argmax(dim=1)

    def scores(self, texts: Sequence[str]) -> torch.Tensor:
        """`[N, K]` the nearest domain's mean objective of each drafter, per text."""
        return self.table[self._nearest(texts)]

    def save(self, directory: str | Path) -> Path:
        """Write `router.safetensors` and `router.json` into `directory`, each atomically."""
        directory = Path(directory)
        write_atomic(directory / "router.safetensors", save({"centroids": self.centroids.contiguous(), "table": self.table.contiguous()}))
        config = {"kind": KIND, "drafters": self.drafters, "domains": self.domains, "embedder": self.embedder_spec,
                  "objective": self.objective}
        write_atomic(directory / "router.json", json.dumps(config, indent=2))
        return directory

    @classmethod
    def load_saved(cls, directory: Path, config: dict[str, Any], embedder: Embedder) -> CentroidRouter:
        """The router `save` wrote to `directory` (router.json already read into `config`)."""
        tensors = load_file(directory / "router.safetensors")
        return cls(embedder, list(config["drafters"]), list(config["domains"]), tensors["centroids"], tensors["table"],
                   config["objective"], config["embedder"])
