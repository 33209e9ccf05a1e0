"""The demo's structured config (conf/demo.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from specdecode.core.config import Placement, require, require_choice
from specdecode.core.paths import CONF_DIR
from specdecode.data.domains import DOMAIN_NAME, DOMAINS
from specdecode.data.registry import check_domains

LAUNCHERS = ("accelerate", "in_process")
# The distillation loss of a domain `losses` does not name.
DEFAULT_LOSS = "forward_kl"
SPECIALISTS_FROM = ("scratch", "generic")


def accelerate_config_file(name: str, device: str = "cpu") -> Path:
    """The accelerate config the launched stages run with: conf/accelerate/<name>.yaml (auto: cpu or
    single_gpu after `device`) or a .yaml path (a ValueError names a missing or mismatched one)."""
    if name == "auto":
        name = "cpu" if device == "cpu" else "single_gpu"
    path = Path(name) if name.endswith((".yaml", ".yml")) else CONF_DIR / "accelerate" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (CONF_DIR / "accelerate").glob("*.yaml"))
        raise ValueError(
            f"accelerate_config={name!r}: no such accelerate config ({path}); auto, one of {known} or a .yaml path"
        )
    if OmegaConf.select(OmegaConf.load(path), "use_cpu", default=False) and device != "cpu":
        raise ValueError(
            f"accelerate_config={name!r} runs on the CPU (use_cpu: true in {path}) but device={device!r}; "
            "use accelerate_config=auto, single_gpu or multi_gpu"
        )
    return path


@dataclass
class DemoConfig(Placement):
    """conf/demo.yaml. `device` / `dtype` reach every stage; `losses` picks each domain's (and `mix`'s)
    distillation loss, DEFAULT_LOSS where not named; each list holds one stage's Hydra overrides."""

    output_dir: str = "outputs/demo"
    domains: list[str] = field(default_factory=lambda: list(DOMAINS))
    losses: dict[str, str] = field(default_factory=dict)
    benchmark: list[str] = field(default_factory=list)
    distill: list[str] = field(default_factory=list)
    # More overrides for one domain drafter's job, after `distill`.
    distill_per_domain: dict[str, list[str]] = field(default_factory=lambda: {d: [] for d in DOMAINS})
    collect: list[str] = field(default_factory=list)
    fit: list[str] = field(default_factory=list)
    eval: list[str] = field(default_factory=list)
    # A second evaluation of the same drafters and router: overrides after `eval`'s; empty: none.
    short_eval: list[str] = field(default_factory=list)
    run_benchmark: bool = True
    # Where each domain drafter starts: scratch, or generic (fine-tuned from the generic drafter, trained first).
    specialists_from: str = "generic"
    # accelerate: training and evaluation run as `accelerate launch <app>`; in_process: in this process.
    launcher: str = "accelerate"
    accelerate_config: str = "auto"
    # The conf/ file each stage composes (smoke runs swap in their own collect and fit configs).
    configs: dict[str, str] = field(
        default_factory=lambda: {
            "benchmark": "benchmark",
            "distill": "distill",
            "collect": "collect",
            "fit": "fit_router",
            "eval": "eval",
        }
    )

    def __post_init__(self) -> None:
        self.check_placement()
        self.domains = check_domains(self.domains)
        require(
            not {"mix", "alldata"} & set(self.domains),
            "domains",
            self.domains,
            "domain names other than mix (the generic drafter's data) and alldata (the all-data control)",
        )
        for domain in self.distill_per_domain:
            require(
                bool(DOMAIN_NAME.fullmatch(str(domain))), "distill_per_domain", domain, "keys that are domain names"
            )
        require(self.launcher in LAUNCHERS, "launcher", self.launcher, f"one of {list(LAUNCHERS)}")
        require_choice("specialists_from", self.specialists_from, SPECIALISTS_FROM)
        if self.launcher == "accelerate":
            accelerate_config_file(self.accelerate_config, self.device)

    def loss(self, name: str) -> str:
        """The distillation loss of domain `name` (or of `mix`, the generic drafter)."""
        return self.losses.get(name, DEFAULT_LOSS)
