"""The schema of the router apps (router/collect.py, router/fit.py): conf/collect.yaml,
conf/fit_router.yaml and the router/ group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdecode.core.config import (
    GAMMA_RANGE,
    TEMPERATURE_RANGE,
    Placement,
    from_dict,
    is_gamma,
    is_number,
    is_temperature,
    require,
    require_choice,
    require_finite,
    require_ints,
)
from specdecode.data.corpus import VOCAB_CORPUS_DOCS
from specdecode.data.domains import DOMAINS
from specdecode.data.registry import check_domains, resolve_domains
from specdecode.decoding.lookup import PromptLookup
from specdecode.models.config import DrafterConfig, TargetConfig

ROUTER_SPLITS = ("train", "heldout")
EMBEDDER_KINDS = ("sentence-transformers", "hashing")


@dataclass
class RoutedDrafterConfig(DrafterConfig):
    """One drafter the router chooses between: a `DrafterConfig` (`pretrained` by default) and its
    `name` in labels and the router."""

    kind: str = "pretrained"
    draft_vocab: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        require(
            isinstance(self.name, str) and bool(self.name.strip()), "drafters[].name", self.name, "a non-empty name"
        )
        try:
            super().__post_init__()
        except ValueError as error:
            raise ValueError(f"drafter {self.name!r}: {error}") from None


def _routed_drafters(value: object) -> list[RoutedDrafterConfig]:
    """The `drafters` list as configs, names unique."""
    require(
        isinstance(value, (list, tuple)) and len(value) >= 2,
        "drafters",
        value,
        "a list of at least 2 {name, kind, path, ...}",
    )
    assert isinstance(value, (list, tuple))  # checked above
    drafters: list[RoutedDrafterConfig] = [
        d if isinstance(d, RoutedDrafterConfig) else from_dict(RoutedDrafterConfig, dict(d), f"drafters[{i}].")
        for i, d in enumerate(value)
    ]
    names = [d.name for d in drafters]
    require(len(set(names)) == len(names), "drafters[].name", names, "names must be unique")
    return drafters


@dataclass
class CollectConfig(Placement):
    """router/collect.py: per-prompt, per-drafter acceptance labels by teacher forcing (routing.labels);
    `cost_ratios` / `verify_ratio` null: measured on this machine."""

    target: TargetConfig = field(default_factory=TargetConfig)
    drafters: list[Any] = field(default_factory=list)
    domains: list[str] = field(default_factory=lambda: list(DOMAINS))
    # Each domain's data config by name; a domain not given is looked up on the config search path.
    data: dict[str, Any] = field(default_factory=dict)
    # Smoke runs: embedded data becomes tiny synthetic examples.
    synthetic: bool = False
    splits: list[str] = field(default_factory=lambda: ["train", "heldout"])
    # Prompts per domain and split (the first ones, deterministic); null = all.
    train_limit: int | None = 300
    heldout_limit: int | None = 50
    # Longer prompts are skipped, never truncated (a cut chat template is not a prompt).
    max_prompt_tokens: int = 256
    # Length of the target's greedy continuation the drafters are scored along.
    max_new_tokens: int = 48
    # Temperature of p and q in Σ min(p, q); 0 = greedy decoding, scored at temperature 1.
    temperature: float = 0.0
    # Score each drafter with prompt lookup beside it, as decoding runs it (conf/eval.yaml's default).
    prompt_lookup: PromptLookup = field(default_factory=PromptLookup)
    # The gamma each drafter's predicted speedup is priced at: null = the one stored with it (4 if none).
    gamma: int | None = None
    batch_size: int = 8
    cost_ratios: dict[str, float] | None = None
    verify_ratio: float | None = None
    cost_repeats: int = 10
    # Training documents tokenised to pick a derived drafter's truncated vocabulary.
    vocab_corpus_docs: int = VOCAB_CORPUS_DOCS
    seed: int = 0
    output: str = "outputs/router/labels.jsonl"

    def __post_init__(self) -> None:
        self.check_placement()
        self.drafters = _routed_drafters(self.drafters)
        self.domains = check_domains(self.domains)
        self.data = resolve_domains(self.domains, self.data, synthetic=self.synthetic)
        require(
            isinstance(self.splits, (list, tuple))
            and bool(self.splits)
            and all(s in ROUTER_SPLITS for s in self.splits),
            "splits",
            self.splits,
            f"a non-empty list of {'|'.join(ROUTER_SPLITS)}",
        )
        require_ints(self, "train_limit heldout_limit", nullable=True)
        require(
            self.gamma is None or is_gamma(self.gamma),
            "gamma",
            self.gamma,
            f"null (each drafter's own) or {GAMMA_RANGE}",
        )
        require_ints(self, "max_prompt_tokens max_new_tokens batch_size cost_repeats vocab_corpus_docs")
        require(is_temperature(self.temperature), "temperature", self.temperature, TEMPERATURE_RANGE)
        names = [d.name for d in self.drafters]
        if self.cost_ratios is not None:
            ratios = dict(self.cost_ratios)
            require(
                sorted(ratios) == sorted(names),
                "cost_ratios",
                ratios,
                f"one ratio per drafter {names}, or null to measure",
            )
            require(all(is_number(c) and c > 0 for c in ratios.values()), "cost_ratios", ratios, "every ratio > 0")
            self.cost_ratios = {k: float(v) for k, v in ratios.items()}
        if self.verify_ratio is not None:
            require_finite("verify_ratio", self.verify_ratio, 0, strict=True, note=" (null: measured)")
        require(bool(self.output) and str(self.output).endswith(".jsonl"), "output", self.output, "a .jsonl path")


@dataclass
class EmbedderConfig:
    """Sentence features for the router: `sentence-transformers` (`name`: the embedded
    `all-MiniLM-L6-v2`, a local folder or a hub id), or `hashing`, a hashed bag of words of `dim`."""

    kind: str = "sentence-transformers"
    name: str = "all-MiniLM-L6-v2"
    dim: int = 256
    batch_size: int = 64
    # Tokens the sentence model reads per prompt: its cost grows with length; a domain shows in the first words.
    max_seq_length: int | None = 64

    def __post_init__(self) -> None:
        require_choice("router.embedder.kind", self.kind, EMBEDDER_KINDS)
        require(bool(self.name), "router.embedder.name", self.name, "a model name or path")
        require_ints(self, "dim batch_size", prefix="router.embedder.")
        require_ints(self, "max_seq_length", nullable=True, prefix="router.embedder.")


@dataclass
class RouterModelConfig:
    """The router: its embedder's features → an MLP that names the prompt's domain."""

    embedder: EmbedderConfig = field(default_factory=EmbedderConfig)
    # Training prompts per domain the MLP learns from beside the labels' own (they need no target pass).
    domain_prompts: int = 400
    hidden: int = 256
    dropout: float = 0.1

    def __post_init__(self) -> None:
        require_ints(self, "domain_prompts", 0, prefix="router.")
        require_ints(self, "hidden", prefix="router.")
        require(is_number(self.dropout) and 0 <= self.dropout < 1, "router.dropout", self.dropout, "in [0, 1)")


@dataclass
class FitRouterConfig(Placement):
    """router/fit.py: fit the router on the labels' train rows, report on their held-out rows."""

    labels: str = "outputs/router/labels.jsonl"
    output_dir: str = "outputs/router"
    router: RouterModelConfig = field(default_factory=RouterModelConfig)
    # Also route to no drafter (plain decoding) on a domain where every drafter is predicted to slow prompts down.
    no_drafter: bool = True
    # Full-batch AdamW steps on the MLP's cross-entropy over the domain-tagged prompts.
    epochs: int = 200
    lr: float = 1e-3
    weight_decay: float = 1e-2
    seed: int = 0
    latency_repeats: int = 5
    # The far-prompt threshold (routing.novelty), per domain at `novelty_quantile` of the distances of
    # `novelty_prompts` unseen training prompts (0: none); a prompt past every one goes to `fallback`.
    novelty_prompts: int = 100
    novelty_quantile: float = 0.99
    fallback: str = "generic"

    def __post_init__(self) -> None:
        self.check_placement()
        require_ints(self, "novelty_prompts", 0)
        require(
            is_number(self.novelty_quantile) and 0 < self.novelty_quantile <= 1,
            "novelty_quantile",
            self.novelty_quantile,
            "a number in (0, 1]",
        )
        require(isinstance(self.fallback, str) and bool(self.fallback), "fallback", self.fallback, "a route name")
        require(
            bool(self.labels) and str(self.labels).endswith(".jsonl"),
            "labels",
            self.labels,
            "a .jsonl file from router/collect.py",
        )
        require(bool(self.output_dir), "output_dir", self.output_dir, "must name a folder")
        require_ints(self, "epochs latency_repeats")
        require_finite("lr", self.lr, 0, strict=True)
        require_finite("weight_decay", self.weight_decay, 0)
