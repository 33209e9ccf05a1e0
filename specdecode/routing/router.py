"""The router: an MLP over a prompt's sentence embedding names its domain, and the prompt takes the
drafter with the highest mean predicted speedup on that domain (`table` [D, K]). What a drafter
earns on one prompt depends mostly on the continuation, which the text does not predict; which
drafter pays on a kind of prompt carries over. A prompt far from every domain takes a fallback
route (`routing.novelty`). On disk: `router.safetensors` and `router.json`.
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
from specdecode.routing.embedders import Embedder, embed, make_embedder
from specdecode.routing.novelty import Novelty, fallback_route

# The route to plain decoding, where every drafter is predicted to slow the prompt down.
NO_DRAFTER = "none"
# The label the table averages and the router ranks drafters by: Leviathan's predicted speedup.
OBJECTIVE = "speedup"

_NAMES = (lambda v: isinstance(v, list) and bool(v) and all(isinstance(x, str) for x in v), "a non-empty list of names")
# router.json's entries, each with its check and what it should be.
_KEYS: dict[str, tuple[Any, str]] = {
    "drafters": _NAMES,
    "domains": _NAMES,
    "embedder": (lambda v: v is None or isinstance(v, dict), "an embedder spec (an object) or null"),
    "num_features": (lambda v: is_int(v) and v >= 1, "an int >= 1"),
    "hidden": (lambda v: is_int(v) and v >= 1, "an int >= 1"),
    "dropout": (lambda v: is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "novelty": (
        lambda v: (
            v is None or isinstance(v, dict) and isinstance(v.get("fallback"), str) and is_number(v.get("quantile"))
        ),
        "null or {fallback, quantile}",
    ),
}


class RouterMLP(nn.Module):
    """`[N, F]` standardised features → `[N, D]` domain logits, one hidden layer."""

    def __init__(self, num_features: int, num_domains: int, hidden: int = 256, dropout: float = 0.1) -> None:
        super().__init__()
        self.hidden, self.dropout = hidden, dropout
        self.layers = nn.Sequential(
            nn.Linear(num_features, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, num_domains)
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.layers(features)


@dataclass(eq=False)
class Router:
    """The domain MLP, its embedder, and what each domain's prompts earn per drafter: feature_mean /
    feature_std `[F]`; table `[D, K]`, each of the D `domains`' mean `OBJECTIVE` per drafter; novelty:
    where prompts far from every domain go (None: nowhere else)."""

    mlp: RouterMLP
    embedder: Embedder
    drafters: list[str]
    domains: list[str]
    feature_mean: torch.Tensor
    feature_std: torch.Tensor
    table: torch.Tensor
    embedder_spec: dict[str, Any] | None = None
    novelty: Novelty | None = None

    def __post_init__(self) -> None:
        if self.novelty is not None:
            fallback_route(self.novelty.fallback, self.drafters, NO_DRAFTER)

    @torch.inference_mode()
    def domain_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Raw features `[N, F]` → domain logits `[N, D]`."""
        self.mlp.eval()
        return self.mlp((features.float() - self.feature_mean) / self.feature_std)

    def domain_of(self, texts: Sequence[str]) -> list[str]:
        """The most probable domain of each text."""
        return [self.domains[i] for i in self.domain_logits(embed(self.embedder, texts)).argmax(1).tolist()]

    def scores(self, texts: Sequence[str]) -> torch.Tensor:
        """`[N, K]` each drafter's mean objective on the text's most probable domain."""
        return self.table[self.domain_logits(embed(self.embedder, texts)).argmax(1)]

    def far(self, texts: Sequence[str]) -> list[bool]:
        """Whether each text lies beyond every domain's far-prompt threshold (all False without one)."""
        if self.novelty is None:
            return [False] * len(texts)
        return self.novelty.is_far(embed(self.embedder, texts)).tolist()

    def route(self, texts: Sequence[str]) -> list[int]:
        """Index into `drafters` of the chosen drafter per text: its domain's best, or the fallback where far."""
        if not texts:
            raise ValueError("texts is empty: nothing to route")
        features = embed(self.embedder, texts)
        choices = self.table[self.domain_logits(features).argmax(1)].argmax(dim=1)
        if self.novelty is not None:
            fallback = self.drafters.index(fallback_route(self.novelty.fallback, self.drafters, NO_DRAFTER))
            choices[self.novelty.is_far(features)] = fallback
        return choices.tolist()

    def choose(self, texts: Sequence[str]) -> list[str]:
        """Name of the chosen drafter per text."""
        return [self.drafters[i] for i in self.route(texts)]

    def save(self, directory: str | Path) -> Path:
        """Write `router.safetensors` and `router.json` into `directory`, each atomically."""
        directory = Path(directory)
        tensors = {f"mlp.{k}": v.contiguous() for k, v in self.mlp.state_dict().items()} | {
            "feature_mean": self.feature_mean.contiguous(),
            "feature_std": self.feature_std.contiguous(),
            "table": self.table.contiguous(),
        }
        if self.novelty is not None:
            tensors |= {
                "novelty.centroids": self.novelty.centroids.contiguous(),
                "novelty.thresholds": self.novelty.thresholds.contiguous(),
            }
        write_atomic(directory / "router.safetensors", save(tensors))
        config = {
            "drafters": self.drafters,
            "domains": self.domains,
            "embedder": self.embedder_spec,
            "num_features": int(self.feature_mean.shape[0]),
            "hidden": self.mlp.hidden,
            "dropout": self.mlp.dropout,
            "novelty": None
            if self.novelty is None
            else {"fallback": self.novelty.fallback, "quantile": self.novelty.quantile},
        }
        write_atomic(directory / "router.json", json.dumps(config, indent=2))
        return directory

    @classmethod
    def load(cls, directory: str | Path, embedder: Embedder | None = None, device: str = "cpu") -> Router:
        """Read a saved router; `embedder` overrides the saved spec, otherwise built on `device`. A
        ValueError names the folder and the file that is missing, damaged or not a router's."""
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
            return cls._from_saved(config, tensors, embedder)
        except (KeyError, RuntimeError, ValueError) as error:
            raise ValueError(
                f"{str(directory / 'router.safetensors')!r} does not hold the router "
                f"{str(directory / 'router.json')!r} describes ({type(error).__name__}: {error}); refit the router"
            ) from None

    @classmethod
    def _from_saved(cls, config: dict[str, Any], tensors: dict[str, torch.Tensor], embedder: Embedder) -> Router:
        """The router of a checked router.json's `config` and router.safetensors' `tensors`."""
        features, domains, drafters = config["num_features"], len(config["domains"]), len(config["drafters"])
        shapes = {"feature_mean": (features,), "feature_std": (features,), "table": (domains, drafters)}
        if config["novelty"] is not None:
            shapes |= {"novelty.centroids": (domains, features), "novelty.thresholds": (domains,)}
        for name, shape in shapes.items():
            if tuple(tensors[name].shape) != shape:
                raise ValueError(f"{name} has shape {tuple(tensors[name].shape)}, expected {shape}")
        mlp = RouterMLP(features, domains, config["hidden"], config["dropout"])
        mlp.load_state_dict({k.removeprefix("mlp."): v for k, v in tensors.items() if k.startswith("mlp.")})
        novelty = None
        if (saved := config["novelty"]) is not None:
            centroids, thresholds = tensors["novelty.centroids"], tensors["novelty.thresholds"]
            novelty = Novelty(centroids, thresholds, saved["fallback"], saved["quantile"])
        return cls(
            mlp.eval(),
            embedder,
            list(config["drafters"]),
            list(config["domains"]),
            tensors["feature_mean"],
            tensors["feature_std"],
            tensors["table"],
            config["embedder"],
            novelty,
        )


def read_router_json(path: Path) -> dict[str, Any]:
    """A router folder's router.json, its entries checked (`_KEYS`); a ValueError naming the file and entry."""
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{str(path)!r} is not valid JSON ({error}): the router folder is damaged; refit the router"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(f"{str(path)!r} holds a JSON {type(config).__name__}, not a router's settings (an object)")
    for key, (check, expected) in _KEYS.items():
        if key not in config:
            raise ValueError(
                f"{str(path)!r} has no {key!r} entry ({expected}): not a router saved by this version; refit the router"
            )
        if not check(config[key]):
            raise ValueError(f"{str(path)!r}: {key}={config[key]!r}: expected {expected}")
    return config


def feature_scale(std: torch.Tensor) -> torch.Tensor:
    """The standardising scale of features of training standard deviation `std` `[F]`: a feature
    constant there keeps scale 1, where a tiny floor would swamp every logit when it first varies."""
    return torch.where(std > 1e-6, std, 1.0)


def label_matrix(rows: Sequence[Mapping[str, Any]], key: str, drafters: Sequence[str]) -> torch.Tensor:
    """`[N, K]` label `key` of each row per drafter; `NO_DRAFTER`'s are exact: speedup 1, else 0."""
    none = 1.0 if "speedup" in key else 0.0
    return torch.tensor([[none if name == NO_DRAFTER else float(row[key][name]) for name in drafters] for row in rows])
