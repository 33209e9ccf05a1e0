"""The router: MLPs over a prompt's features that score each drafter, averaged, and its files.

    text ─ embedder ─▶ [D] ⊕ log(1 + chars) ─ standardise ─▶ E MLPs ─▶ mean ─▶ [K] scores ─▶ argmax drafter

Different prompts are accepted best by different drafters (code by the code drafter, ...). The
router regresses, per drafter, the label `specdecode.routing.labels` measured (predicted speedup by
default, or acceptance) from the prompt text alone, and routes each prompt to the argmax; fitting
is `specdecode.routing.fit`, routed decoding `specdecode.routing.generate`. It is an ensemble of E
MLPs, each fitted on its own seeded train / validation split with its own statistics, whose
de-standardised scores are averaged: per-prompt labels are noisy and a single fit's held-out
choices depend on its split.

On disk a router is `router.safetensors` (each member's weights, feature and target statistics)
and `router.json` (the drafters it routes between, in order, the embedder, features and sizes).
Routers saved before ensembles (one MLP, no `members` in router.json) load as one member.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save
from torch import nn

from specdecode.core.atomic import write_atomic
from specdecode.core.config import is_int, is_number
from specdecode.models.folders import read_safetensors
from specdecode.routing.choice import ArgmaxRouting
from specdecode.routing.domain import KIND as DOMAIN
from specdecode.routing.domain import DomainRouter
from specdecode.routing.embedders import Embedder, make_embedder, prompt_features

# The route to plain decoding: chosen where every drafter is predicted to slow the prompt down.
# Its labels are known without measuring: speedup 1, acceptance 0.
NO_DRAFTER = "none"

_NAMES = (lambda v: isinstance(v, list) and bool(v) and all(isinstance(x, str) for x in v), "a non-empty list of names")
# router.json's entries, each with its check and what it should be: every router, then MLP and domain routers.
_COMMON_KEYS: dict[str, tuple[Any, str]] = {
    "drafters": _NAMES,
    "embedder": (lambda v: v is None or isinstance(v, dict), "an embedder spec (an object) or null"),
    "objective": (lambda v: isinstance(v, str), "a label name"),
}
_MLP_KEYS: dict[str, tuple[Any, str]] = {
    "features": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of feature names"),
    "num_features": (lambda v: is_int(v) and v >= 1, "an int >= 1"),
    "hidden": (lambda v: is_int(v) and v >= 1, "an int >= 1"),
    "dropout": (lambda v: is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "relative": (lambda v: isinstance(v, bool), "true or false"),
}
_DOMAIN_KEYS: dict[str, tuple[Any, str]] = {"domains": _NAMES}


class RouterMLP(nn.Module):
    """`[N, F]` standardised features → `[N, K]` standardised scores, one hidden layer."""

    def __init__(self, num_features: int, num_drafters: int, hidden: int = 256, dropout: float = 0.1) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(num_features, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, num_drafters)
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.layers(features)


@dataclass(eq=False)
class Router(ArgmaxRouting):
    """E MLPs, their embedder and the statistics that map raw features in and scores out.

    mlp: the E members; feature_mean / feature_std: `[E, F]`; target_mean / target_std: `[E, K]`
    (member e's own); drafters: the K names, in the MLPs' output order.
    """

    mlp: nn.ModuleList
    embedder: Embedder
    drafters: list[str]
    feature_mean: torch.Tensor
    feature_std: torch.Tensor
    target_mean: torch.Tensor
    target_std: torch.Tensor
    prompt_length: bool = True
    objective: str = "speedup"
    relative: bool = True
    embedder_spec: dict[str, Any] | None = None
    hidden: int = 256
    dropout: float = 0.1

    @torch.inference_mode()
    def scores_from_features(self, features: torch.Tensor) -> torch.Tensor:
        """Raw features `[N, F]` → predicted objective per drafter `[N, K]` (relative to the
        prompt's mean over drafters when `relative`), the mean over the E members."""
        self.mlp.eval()
        scores = [
            member((features - self.feature_mean[e]) / self.feature_std[e]) * self.target_std[e] + self.target_mean[e]
            for e, member in enumerate(self.mlp)
        ]
        return torch.stack(scores).mean(0)

    @property
    def members(self) -> int:
        """E, the number of MLPs averaged."""
        return len(self.mlp)

    def scores(self, texts: Sequence[str]) -> torch.Tensor:
        """`[N, K]` predicted objective of each drafter for each text."""
        return self.scores_from_features(prompt_features(self.embedder, texts, prompt_length=self.prompt_length))

    def save(self, directory: str | Path) -> Path:
        """Write `router.safetensors` and `router.json` into `directory`, each atomically."""
        directory = Path(directory)
        tensors = {f"mlp.{k}": v.contiguous() for k, v in self.mlp.state_dict().items()} | {
            "feature_mean": self.feature_mean,
            "feature_std": self.feature_std,
            "target_mean": self.target_mean,
            "target_std": self.target_std,
        }
        write_atomic(directory / "router.safetensors", save(tensors))
        config = {
            "drafters": self.drafters,
            "embedder": self.embedder_spec,
            "features": ["embedding", "log1p_chars"] if self.prompt_length else ["embedding"],
            "num_features": int(self.feature_mean.shape[-1]),
            "members": self.members,
            "hidden": self.hidden,
            "dropout": self.dropout,
            "objective": self.objective,
            "relative": self.relative,
        }
        write_atomic(directory / "router.json", json.dumps(config, indent=2))
        return directory

    @classmethod
    def load(cls, directory: str | Path, embedder: Embedder | None = None, device: str = "cpu") -> Router:
        """Read a saved router (an MLP one, or a `DomainRouter`); `embedder` overrides (or, for a
        custom one, supplies) the saved spec, which is otherwise built on `device`.

        Raises:
            ValueError: naming the folder and the file that is missing, damaged or not a router's
                (router.json: not JSON, a missing or mistyped entry; router.safetensors: truncated,
                or tensors that do not fit router.json).
        """
        directory = Path(directory)
        for name in ("router.json", "router.safetensors"):
            if not (directory / name).is_file():
                raise ValueError(f"router directory {str(directory)!r} has no {name}")
        config = read_router_json(directory / "router.json")
        tensors = read_safetensors(directory / "router.safetensors")
        if embedder is None:
            if config["embedder"] is None:
                raise ValueError(f"router {str(directory)!r} was fitted with a custom embedder; pass embedder=")
            try:
                embedder = make_embedder(config["embedder"], device)
            except (TypeError, ValueError) as error:
                raise ValueError(
                    f"{str(directory / 'router.json')!r}: embedder={config['embedder']!r}: {error}"
                ) from None
        try:
            if config.get("kind") == DOMAIN:
                return DomainRouter.load_saved(directory, config, embedder)  # type: ignore[return-value]
            return cls._from_saved(config, tensors, embedder)
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as error:
            raise ValueError(
                f"{str(directory / 'router.safetensors')!r} does not hold the router "
                f"{str(directory / 'router.json')!r} "
                f"describes ({type(error).__name__}: {error}); refit the router"
            ) from None

    @classmethod
    def _from_saved(cls, config: dict[str, Any], tensors: dict[str, torch.Tensor], embedder: Embedder) -> Router:
        """The router of a checked router.json's `config` and router.safetensors' `tensors`."""
        if "members" not in config:  # saved before ensembles: one MLP, `[F]` / `[K]` statistics
            tensors = {
                f"mlp.0.{k.removeprefix('mlp.')}" if k.startswith("mlp.") else k: v
                if k.startswith("mlp.")
                else v.unsqueeze(0)
                for k, v in tensors.items()
            }
        members, num_features, num_drafters = config.get("members", 1), config["num_features"], len(config["drafters"])
        for name, shape in (
            ("feature_mean", (members, num_features)),
            ("feature_std", (members, num_features)),
            ("target_mean", (members, num_drafters)),
            ("target_std", (members, num_drafters)),
        ):
            if tuple(tensors[name].shape) != shape:
                raise ValueError(
                    f"{name} has shape {tuple(tensors[name].shape)}, expected {shape} (members, features or drafters)"
                )
        mlp = nn.ModuleList(
            RouterMLP(num_features, num_drafters, config["hidden"], config["dropout"]) for _ in range(members)
        )
        mlp.load_state_dict({k.removeprefix("mlp."): v for k, v in tensors.items() if k.startswith("mlp.")})
        # Older routers floored such a feature's scale at 1e-6 instead: it was 0 on every training
        # row, so scale 1 changes nothing there and stops it swamping new prompts' scores.
        return cls(
            mlp.eval(),
            embedder,
            list(config["drafters"]),
            tensors["feature_mean"],
            feature_scale(tensors["feature_std"]),
            tensors["target_mean"],
            tensors["target_std"],
            prompt_length="log1p_chars" in config["features"],
            objective=config["objective"],
            relative=config["relative"],
            embedder_spec=config["embedder"],
            hidden=config["hidden"],
            dropout=config["dropout"],
        )


def read_router_json(path: Path) -> dict[str, Any]:
    """A router folder's router.json, its entries checked (`_COMMON_KEYS` and the kind's own).

    Raises:
        ValueError: naming the file and the entry: not JSON, not an object, a missing or mistyped entry.
    """
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{str(path)!r} is not valid JSON ({error}): the router folder is damaged; refit the router"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(f"{str(path)!r} holds a JSON {type(config).__name__}, not a router's settings (an object)")
    kind = config.get("kind", "mlp")
    if kind not in ("mlp", DOMAIN):
        raise ValueError(f"{str(path)!r}: kind={kind!r}: expected {DOMAIN!r} or absent (an MLP router)")
    for key, (check, expected) in (_COMMON_KEYS | (_DOMAIN_KEYS if kind == DOMAIN else _MLP_KEYS)).items():
        if key not in config:
            raise ValueError(
                f"{str(path)!r} has no {key!r} entry ({expected}): not a router saved by this version; refit the router"
            )
        if not check(config[key]):
            raise ValueError(f"{str(path)!r}: {key}={config[key]!r}: expected {expected}")
    members = config.get("members", 1)
    if not (is_int(members) and members >= 1):
        raise ValueError(f"{str(path)!r}: members={members!r}: expected an int >= 1")
    return config


def feature_scale(std: torch.Tensor) -> torch.Tensor:
    """The standardising scale of features with training-row standard deviation `std` `[..., F]`.
    A feature constant on the training rows (a hashing bucket no training prompt fills) keeps
    scale 1: a tiny floor there would multiply it by ~1e6 for the first prompt that has it and
    swamp every score."""
    return torch.where(std > 1e-6, std, 1.0)


def label_matrix(rows: Sequence[Mapping[str, Any]], key: str, drafters: Sequence[str]) -> torch.Tensor:
    """`[N, K]` label `key` of each row for each drafter, in `drafters` order; `NO_DRAFTER`'s are
    exact without measuring: plain decoding is the speedup baseline (1) and accepts nothing (0)."""
    none = 1.0 if "speedup" in key else 0.0
    return torch.tensor([[none if name == NO_DRAFTER else float(row[key][name]) for name in drafters] for row in rows])
