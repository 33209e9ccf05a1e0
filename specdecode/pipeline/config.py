"""The demo's structured config (conf/demo.yaml): the one placement, the domains, each domain's
loss, the Hydra overrides each stage composes its own config with, and how the training and
evaluation stages are launched."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from specdecode.core.config import Placement, require
from specdecode.core.paths import CONF_DIR
from specdecode.data.domains import DOMAIN_NAME, DOMAINS
from specdecode.data.registry import check_domains

LAUNCHERS = ("accelerate", "in_process")
# The distillation loss of a domain `losses` does not name.
DEFAULT_LOSS = "forward_kl"
SPECIALISTS_FROM = ("scratch", "generic")


def accelerate_config_file(name: str, device: str = "cpu") -> Path:
    """The accelerate config the launched stages run with: `auto` picks conf/accelerate/cpu.yaml
    for `device=cpu` and single_gpu.yaml otherwise; `cpu` → conf/accelerate/cpu.yaml; a path ending
    in .yaml is taken as it is.

    Raises ValueError: naming the value and the configs conf/accelerate/ holds, if there is no such
    file; or if the file runs on the CPU (`use_cpu: true`) while `device` is not the CPU (accelerate
    would move the models back to the CPU).
    """
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
    """conf/demo.yaml. `device` / `dtype` reach every stage (`python eval/demo.py device=cuda
    dtype=bfloat16` is the GPU demo); `losses` picks each domain's distillation loss (and `mix`'s,
    the generic one). `domains` are any domains defined by conf/data/<name>.yaml on the config search
    path (`hydra.searchpath=[file:///your/conf]` adds yours); a domain that `losses` or
    `distill_per_domain` does not name trains with DEFAULT_LOSS and the shared `distill` overrides."""

    output_dir: str = "outputs/demo"
    domains: list[str] = field(default_factory=lambda: list(DOMAINS))
    losses: dict[str, str] = field(default_factory=dict)
    benchmark: list[str] = field(default_factory=list)
    distill: list[str] = field(default_factory=list)
    # More overrides for one domain drafter's job, after `distill` (the generic drafter's job takes
    # none): e.g. {chat: [train.train_sequences=3840]} for the data-bound domain.
    distill_per_domain: dict[str, list[str]] = field(default_factory=lambda: {d: [] for d in DOMAINS})
    collect: list[str] = field(default_factory=list)
    fit: list[str] = field(default_factory=list)
    eval: list[str] = field(default_factory=list)
    # A second evaluation of the same drafters and router: overrides after `eval`'s (e.g. shorter
    # answers, to set beside the first); empty: none.
    short_eval: list[str] = field(default_factory=list)
    run_benchmark: bool = True
    # Where each domain drafter starts: scratch (a fresh drafter of the distill config's kind) or
    # generic (the generic drafter, which then trains first, on every domain's data): a domain
    # drafter fine-tuned from it saw all the domains' data, and its best checkpoint is selected on its
    # domain with the generic drafter itself as step 0.
    specialists_from: str = "generic"
    # The training and evaluation stages run as `accelerate launch <app>` with
    # conf/accelerate/<accelerate_config>.yaml (auto: cpu or single_gpu after `device`; multi_gpu:
    # DDP over the GPUs) or a .yaml path; in_process calls the library in this process.
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
        require(
            self.specialists_from in SPECIALISTS_FROM,
            "specialists_from",
            self.specialists_from,
            "|".join(SPECIALISTS_FROM),
        )
        if self.launcher == "accelerate":
            accelerate_config_file(self.accelerate_config, self.device)

    def loss(self, name: str) -> str:
        """The distillation loss of domain `name` (or of `mix`, the generic drafter)."""
        return self.losses.get(name, DEFAULT_LOSS)
