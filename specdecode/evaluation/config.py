"""The schema of the evaluation apps: eval/benchmark.py (conf/benchmark.yaml) and
eval/acceptance.py (conf/eval.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdecode.core.config import (
    GAMMA_RANGE,
    TEMPERATURE_RANGE,
    Placement,
    is_gamma,
    is_temperature,
    require,
    require_int,
    require_ints,
)
from specdecode.core.tracking import Tracking
from specdecode.data.corpus import VOCAB_CORPUS_DOCS
from specdecode.data.domains import DOMAINS
from specdecode.data.registry import check_domains, resolve_domains
from specdecode.decoding.decode import AUTO
from specdecode.decoding.lookup import PromptLookup
from specdecode.models.config import DrafterConfig, TargetConfig


@dataclass
class BenchmarkConfig(Placement):
    """eval/benchmark.py: target alone vs ours vs transformers assisted generation, batch 1 and B."""

    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    gamma: int = 4
    max_new_tokens: int = 128
    # Prompts: the first held-out prompts of each domain, interleaved (code, math, chat, code, ...).
    num_prompts: int = 8
    max_prompt_tokens: int = 256
    batch1_prompts: int = 3
    batch_size: int = 8
    # Timed rounds after each method's first call, the methods interleaved; 0: the first call is the timed one.
    rounds: int = 0
    temperature: float = 0.0
    seed: int = 0
    hf_assisted: bool = True
    # Off: the benchmark compares decode loops with one and the same drafter.
    prompt_lookup: PromptLookup = field(default_factory=lambda: PromptLookup(enabled=False))
    cost_repeats: int = 10
    # Documents per domain tokenised to pick the drafter's truncated vocabulary.
    vocab_corpus_docs: int = VOCAB_CORPUS_DOCS
    output_dir: str = "outputs/benchmark"

    def __post_init__(self) -> None:
        self.check_placement()
        require(is_gamma(self.gamma), "gamma", self.gamma, GAMMA_RANGE)
        require_ints(self, "max_new_tokens num_prompts cost_repeats")
        require_ints(self, "rounds", 0)
        for name in ("batch1_prompts", "batch_size"):
            require_int(name, getattr(self, name), 1, self.num_prompts, note=" (num_prompts)")
        require(is_temperature(self.temperature), "temperature", self.temperature, TEMPERATURE_RANGE)


# The evaluation's methods (conf/eval.yaml says what each decodes with).
EVAL_METHODS = frozenset(
    {"autoregressive", "undistilled", "generic", "alldata", "specialized", "routed", "routed_grouped", "oracle"}
)


@dataclass
class EvalConfig(Placement, Tracking):
    """eval/acceptance.py. `drafters` maps a name (`generic`, `alldata`, or a domain for its specialised
    drafter) to a drafter folder; `router_dir` is a fitted router folder (for `routed`)."""

    target: TargetConfig = field(default_factory=TargetConfig)
    undistilled: DrafterConfig = field(default_factory=DrafterConfig)
    drafters: dict[str, str] = field(default_factory=dict)
    router_dir: str | None = None
    domains: list[str] = field(default_factory=lambda: list(DOMAINS))
    # Each domain's data config by name; a domain not given is looked up on the config search path.
    data: dict[str, Any] = field(default_factory=dict)
    # Smoke runs: embedded data becomes tiny synthetic examples.
    synthetic: bool = False
    methods: list[str] = field(
        default_factory=lambda: ["autoregressive", "undistilled", "generic", "specialized", "routed", "oracle"]
    )
    prompts_per_domain: int = 10
    # Of those, the first `batch1_prompts` are decoded at batch 1 (and in the sweep); null: all.
    batch1_prompts: int | None = None
    max_prompt_tokens: int = 256
    max_new_tokens: int = 64
    # null: each drafter at the gamma stored with it (4 if none); an int: every drafter at it; auto: chosen per step.
    gamma: int | str | None = None
    # Prompt lookup beside every drafter (routed and oracle included).
    prompt_lookup: PromptLookup = field(default_factory=PromptLookup)
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7, 1.0])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    # Past batch 1 a row is a few batches: its methods take turns this many times, each row its median round.
    batched_rounds: int = 1
    # Gamma sweep: `sweep_methods` also run at each of `sweep_gammas`, at the smallest batch size and
    # at each temperature in `sweep_temperatures` (that is also in `temperatures`). Empty: no sweep.
    sweep_gammas: list[int] = field(default_factory=list)
    sweep_methods: list[str] = field(default_factory=lambda: ["generic", "routed"])
    sweep_temperatures: list[float] = field(default_factory=lambda: [0.0])
    # Held-out prompts per domain shown token by token in tokens-<domain>.html (routed, else generic;
    # greedy, batch 1, decoded after the timed runs); 0: no pages.
    token_pages: int = 3
    seed: int = 0
    output_dir: str = "outputs/eval"

    def __post_init__(self) -> None:
        self.check_placement()
        self.check_tracking()
        check_domains(self.domains)
        self.data = resolve_domains(self.domains, self.data, synthetic=self.synthetic)
        self._check_methods()
        require_ints(self, "prompts_per_domain max_new_tokens batched_rounds")
        require_ints(self, "token_pages", 0)
        require_int("batch1_prompts", self.batch1_prompts, 1, self.prompts_per_domain, True, " (prompts_per_domain)")
        require(
            self.gamma is None or self.gamma == AUTO or is_gamma(self.gamma),
            "gamma",
            self.gamma,
            f"null (each drafter's own), {AUTO} (chosen per step) or {GAMMA_RANGE}",
        )
        require(
            bool(self.temperatures), "temperatures", self.temperatures, f"a non-empty list, each {TEMPERATURE_RANGE}"
        )
        for t in self.temperatures:
            require(is_temperature(t), "temperatures", t, TEMPERATURE_RANGE)
        require(bool(self.batch_sizes), "batch_sizes", self.batch_sizes, "a non-empty list of ints >= 1")
        for b in self.batch_sizes:
            require_int("batch_sizes", b, 1)
        if "oracle" in self.methods:
            require(
                1 in self.batch_sizes,
                "batch_sizes",
                self.batch_sizes,
                "must include 1 for method oracle (it picks from batch-1 runs)",
            )
        for g in self.sweep_gammas:
            require(is_gamma(g), "sweep_gammas", g, GAMMA_RANGE)
        # With stored gammas the main rows would land on the sweep's gammas (a routed row mixes several).
        require(
            not self.sweep_gammas or self.gamma is not None,
            "gamma",
            self.gamma,
            f"an int or {AUTO} when sweep_gammas={self.sweep_gammas} (e.g. gamma=2): "
            "the sweep's rows sit beside the main gamma's",
        )
        for method in self.sweep_methods:
            require(
                method in ("undistilled", "generic", "alldata", "routed")
                or method.removeprefix("specialized:") in self.domains
                and method.startswith("specialized:"),
                "sweep_methods",
                method,
                "undistilled, generic, alldata, routed or specialized:<domain>",
            )

    def _check_methods(self) -> None:
        """The methods are known, and each has the drafter folders or router it decodes with."""
        for method in self.methods:
            require(method in EVAL_METHODS, "methods", method, f"one of {sorted(EVAL_METHODS)}")
        require("autoregressive" in self.methods, "methods", self.methods, "must include autoregressive (the baseline)")
        for single in ("generic", "alldata"):
            if single in self.methods:
                require(single in self.drafters, f"drafters.{single}", None, f"method {single} needs a drafter folder")
        for method in {"routed", "routed_grouped"} & set(self.methods):
            require(
                bool(self.router_dir), "router_dir", self.router_dir, f"method {method} needs a fitted router folder"
            )
        # a routed run may name drafters for the router's domains: checked against the router when it loads
        routed = bool({"routed", "routed_grouped"} & set(self.methods))
        for name, path in self.drafters.items():
            require(
                name in ("generic", "alldata") or name in self.domains or routed,
                "drafters",
                name,
                f"generic or one of domains={self.domains} (or alldata, the all-data control; any name the "
                "router chooses, with a routed method)",
            )
            require(Path(path).exists(), f"drafters.{name}", path, "does not exist")
