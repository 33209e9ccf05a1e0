"""The main job on the embedded default: benchmark → distill per domain and on the mix → router
labels → router fit → evaluation, each stage cached by its resolved config (`make demo`).

Every stage's config is composed from the checked-in YAML under conf/ with the demo's overrides,
so the demo runs exactly what the individual commands run, and its cache key is that config.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from specdecode.core.atomic import write_atomic
from specdecode.core.config import Placement, from_dict, require
from specdecode.core.devices import resolve_device
from specdecode.core.locking import locks_output_dir
from specdecode.data.domains import DOMAINS
from specdecode.evaluation.config import BenchmarkConfig
from specdecode.pipeline.stages import Stage, run_stages
from specdecode.routing.config import CollectConfig, FitRouterConfig
from specdecode.training.config import TrainJobConfig

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


@dataclass
class DemoConfig(Placement):
    """conf/demo.yaml. `device` / `dtype` reach every stage (`python eval/demo.py device=cuda
    dtype=bfloat16` is the GPU demo); `losses` picks each domain's distillation loss (and `mix`'s,
    the generic one)."""

    output_dir: str = "outputs/demo"
    domains: list[str] = field(default_factory=lambda: list(DOMAINS))
    losses: dict[str, str] = field(default_factory=lambda: {d: "forward_kl" for d in (*DOMAINS, "mix")})
    benchmark: list[str] = field(default_factory=list)
    distill: list[str] = field(default_factory=list)
    collect: list[str] = field(default_factory=list)
    fit: list[str] = field(default_factory=list)
    eval: list[str] = field(default_factory=list)
    run_benchmark: bool = True
    # The conf/ file each stage composes (smoke runs swap in their own collect and fit configs).
    configs: dict[str, str] = field(
        default_factory=lambda: {"benchmark": "benchmark", "distill": "distill", "collect": "collect", "fit": "fit_router", "eval": "eval"}
    )

    def __post_init__(self) -> None:
        self.check_placement()
        for domain in self.domains:
            require(domain in DOMAINS, "domains", domain, f"one of {list(DOMAINS)}")
        for name in (*self.domains, "mix"):
            require(name in self.losses, f"losses.{name}", None, "each domain and mix needs a loss")


def compose_config(config_name: str, overrides: list[str]) -> dict[str, Any]:
    """The resolved config `python <app>.py <overrides>` would run with."""
    if GlobalHydra.instance().is_initialized():
        # Inside a @hydra.main app (eval/demo.py), whose search path is this same conf/.
        cfg = compose(config_name=config_name, overrides=overrides)
    else:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=overrides)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved.pop("hydra", None)
    return resolved  # type: ignore[return-value]


def _benchmark(config: dict, out: Path) -> None:
    from specdecode.evaluation.benchmark import run_benchmark

    run_benchmark(from_dict(BenchmarkConfig, config | {"output_dir": str(out)}))


def _distill(config: dict, out: Path) -> None:
    from specdecode.training.job import run_distill

    run_distill(from_dict(TrainJobConfig, config | {"output_dir": str(out)}))


def _collect(config: dict, out: Path) -> None:
    from specdecode.routing.collect import run_collect

    run_collect(from_dict(CollectConfig, config | {"output": str(out / "labels.jsonl")}))


def _fit(config: dict, out: Path) -> None:
    from specdecode.routing.fit import run_fit

    run_fit(from_dict(FitRouterConfig, config | {"output_dir": str(out)}))


def _eval(config: dict, out: Path) -> None:
    from specdecode.evaluation.config import EvalConfig
    from specdecode.evaluation.suite import run_eval

    run_eval(from_dict(EvalConfig, config | {"output_dir": str(out)}))


def demo_stages(cfg: DemoConfig) -> list[Stage]:
    """The stages in dependency order. Paths between stages point at final stage folders.

    The wiring between stages (the device and dtype, paths under output_dir, the domains, gamma)
    is set on the composed configs, never spliced into override strings: a path may hold quotes,
    commas or `${`.
    """
    root = Path(cfg.output_dir)
    placement = {"device": cfg.device, "dtype": cfg.dtype, "skinny_matmul": cfg.skinny_matmul}

    def composed(stage: str, overrides: list[str]) -> dict[str, Any]:
        return compose_config(cfg.configs[stage], overrides) | placement

    evaluation = composed("eval", list(cfg.eval))
    # gamma is declared once, by the evaluation: the benchmark and the router's speedup labels
    # describe the setting the evaluation runs (null there = each drafter's own; they keep theirs).
    gamma = {"gamma": evaluation["gamma"]} if evaluation["gamma"] is not None else {}
    stages: list[Stage] = []
    if cfg.run_benchmark:
        stages.append(Stage("benchmark", composed("benchmark", list(cfg.benchmark)) | gamma, _benchmark))
    drafter_dirs: dict[str, str] = {}
    for name in (*cfg.domains, "mix"):
        stage = f"distill-{name}"
        stages.append(Stage(stage, composed("distill", [f"data={name}", f"loss={cfg.losses[name]}", *cfg.distill]), _distill))
        drafter_dirs["generic" if name == "mix" else name] = str(root / stage / "drafter")
    distills = [s.name for s in stages if s.name.startswith("distill-")]
    evaluation |= {"drafters": evaluation["drafters"] | drafter_dirs, "router_dir": str(root / "fit"), "domains": list(cfg.domains)}
    drafters = [{"name": n, "kind": "pretrained", "path": p} for n, p in drafter_dirs.items()]
    collect = composed("collect", list(cfg.collect)) | {"drafters": drafters, "domains": list(cfg.domains)} | gamma
    stages.append(Stage("collect", collect, _collect, after=distills))
    fit = composed("fit", list(cfg.fit)) | {"labels": str(root / "collect" / "labels.jsonl")}
    stages.append(Stage("fit", fit, _fit, after=["collect"]))
    stages.append(Stage("eval", evaluation, _eval, after=[*distills, "fit"]))
    return stages


@locks_output_dir
def run_demo(cfg: DemoConfig) -> Path:
    """Run (or resume) the demo; publish results.json and report.md at the top of `output_dir`."""
    resolve_device(cfg.device)  # a device this machine lacks fails here, before any stage runs
    root = Path(cfg.output_dir)
    outputs = run_stages(demo_stages(cfg), root)
    evaluation = outputs["eval"]
    for png in evaluation.glob("*.png"):
        shutil.copy2(png, root / png.name)
    results = json.loads((evaluation / "results.json").read_text())
    results["stages"] = {name: str(path) for name, path in outputs.items()}
    write_atomic(root / "results.json", json.dumps(results, indent=2))
    report = [(evaluation / "report.md").read_text()]
    for name, title in (("benchmark", "Decode benchmark"), ("fit", "Router")):
        if name in outputs and (outputs[name] / "report.md").is_file():
            report += ["", f"## {title} (stage `{name}`)", "", (outputs[name] / "report.md").read_text()]
    report += [
        "",
        "## Distillation (held-out expected acceptance, mean Σ min(p, q))",
        "",
        "| drafter | loss | before | best | gain | steps | train tokens/s | peak memory MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, path in outputs.items():
        metrics_path = path / "metrics.json"
        if name.startswith("distill-") and metrics_path.is_file():
            m = json.loads(metrics_path.read_text())
            report.append(
                f"| {m['data']} | {m['loss']} | {m['acceptance_before']:.3f} | {m['acceptance_best']:.3f} | "
                f"{m['acceptance_gain']:+.3f} | {m['steps']} | {m['train_tokens_per_s']:.0f} | {m['peak_memory_mb']:.0f} |"
            )
    write_atomic(root / "report.md", "\n".join(report) + "\n")
    return root
