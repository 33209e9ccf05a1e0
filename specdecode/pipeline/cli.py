"""The `specdecode` command: one entry point for the apps, from a checkout or an installed wheel.

    specdecode demo --config-name demo_smoke      # eval/demo.py: benchmark, distill, route, evaluate
    specdecode train data=code loss=tvd           # train/distill.py
    specdecode finetune data=math                 # train/finetune.py
    specdecode collect | fit                      # router/collect.py, router/fit.py
    specdecode eval | benchmark                   # eval/acceptance.py, eval/benchmark.py
    specdecode watch demo_dir=outputs/demo        # eval/watch.py
    specdecode report multirun_dir=<folder>       # eval/report.py
    specdecode export drafter=<folder> format=vllm-eagle output=<folder> [target=<name>] [push_to_hub=<owner/name>]

The scripts in train/, router/ and eval/ call `run_hydra_app` too: one front door, one multirun rule.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdecode.core.paths import CONF_DIR


def _benchmark(cfg: Any) -> None:
    from specdecode.evaluation.benchmark import report_markdown, run_benchmark

    print(report_markdown(run_benchmark(cfg)))


def _demo(cfg: Any) -> None:
    from specdecode.pipeline.demo import run_demo

    print((run_demo(cfg) / "report.md").read_text())


# app → (its config in conf/, the `module:function` that runs it, the script it stands for)
HYDRA_APPS: dict[str, tuple[str, str, str]] = {
    "train": ("distill", "specdecode.training.job:run_distill", "train/distill.py"),
    "finetune": ("finetune", "specdecode.training.job:run_finetune", "train/finetune.py"),
    "collect": ("collect", "specdecode.routing.collect:run_collect", "router/collect.py"),
    "fit": ("fit_router", "specdecode.routing.fit:run_fit", "router/fit.py"),
    "eval": ("eval", "specdecode.evaluation.suite:run_eval", "eval/acceptance.py"),
    "benchmark": ("benchmark", "specdecode.pipeline.cli:_benchmark", "eval/benchmark.py"),
    "demo": ("demo", "specdecode.pipeline.cli:_demo", "eval/demo.py"),
    "watch": ("watch", "specdecode.watch.terminal:run_watch", "eval/watch.py"),
}
APPS = (*HYDRA_APPS, "report", "export")
USAGE = f"usage: specdecode {{{','.join(APPS)}}} [overrides]  (`specdecode --help`)"


def run_hydra_app(app: str, args: Sequence[str] | None = None) -> None:
    """Run `app` under Hydra with `args` as its command line (default: this process's); under a
    multirun each job writes into its sweep subdir in place of the config's `output_dir`."""
    args = sys.argv[1:] if args is None else args
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import DictConfig, OmegaConf

    from specdecode.pipeline.schemas import register_schemas

    config_name, function, _ = HYDRA_APPS[app]
    module, _, name = function.partition(":")
    run = getattr(importlib.import_module(module), name)
    register_schemas()  # conf/*.yaml list their schema (the dataclass) first

    def task(cfg: DictConfig) -> None:
        if HydraConfig.get().mode == RunMode.MULTIRUN and "output_dir" in cfg:
            cfg.output_dir = HydraConfig.get().runtime.output_dir
        run(OmegaConf.to_object(cfg))

    main = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)(task)
    saved = sys.argv
    sys.argv = [f"specdecode {app}", *args]
    try:
        main()
    finally:
        sys.argv = saved


def parse_pairs(args: Sequence[str], required: set[str], optional: set[str], usage: str) -> dict[str, str]:
    """`key=value` arguments as a dict; a SystemExit naming the bad or missing key and the usage."""
    pairs: dict[str, str] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or key not in required | optional:
            raise SystemExit(f"specdecode: unexpected argument {arg!r}\n{usage}")
        pairs[key] = value
    if missing := sorted(required - set(pairs)):
        raise SystemExit(f"specdecode: missing {', '.join(k + '=' for k in missing)}\n{usage}")
    return pairs


def report(args: Sequence[str]) -> None:
    """Merge a gamma multirun of `specdecode eval -m gamma=...` into one report (eval/report.py)."""
    import json

    from specdecode.core.atomic import write_atomic
    from specdecode.evaluation.report import merge_results, write_report

    root = Path(
        parse_pairs(args, {"multirun_dir"}, set(), "usage: specdecode report multirun_dir=<folder>")["multirun_dir"]
    )
    results = merge_results(root.glob("*/results.json"))
    write_atomic(root / "results.json", json.dumps(results, indent=2))
    print(write_report(results, root))


EXPORT_USAGE = (
    "usage: specdecode export drafter=<trained drafter folder> format=<format> output=<new folder> "
    "[target=<target name; default: the training config beside the drafter>] "
    "[num_speculative_tokens=<int>] [push_to_hub=<owner/name>]"
)


def export(args: Sequence[str]) -> Path:
    """Write a trained drafter in an engine's format, optionally pushed to the hub; the target defaults
    to the one the training job beside the drafter named."""
    from specdecode.models.eagle_export import FORMATS

    pairs = parse_pairs(
        args, {"drafter", "format", "output"}, {"target", "num_speculative_tokens", "push_to_hub"}, EXPORT_USAGE
    )
    if pairs["format"] not in FORMATS:  # before loading any model
        raise SystemExit(f"specdecode export: format={pairs['format']!r}: expected one of {'|'.join(FORMATS)}")
    gamma = pairs.get("num_speculative_tokens")
    if gamma is not None and not (gamma.isdigit() and int(gamma) >= 1):
        raise SystemExit(f"specdecode export: num_speculative_tokens={gamma!r}: expected an int >= 1")
    drafter_dir = Path(pairs["drafter"])
    if not drafter_dir.is_dir():
        raise SystemExit(f"specdecode export: drafter={pairs['drafter']!r}: no such drafter folder")
    target_name = pairs.get("target") or _trained_target(drafter_dir)
    if Path(pairs["output"]).exists():
        raise SystemExit(f"specdecode export: output={pairs['output']!r} exists; pick a new folder")

    from specdecode.models.card import push_to_hub
    from specdecode.models.eagle_export import export_drafter
    from specdecode.models.loading import as_target, load_drafter, load_model

    target = as_target(load_model(target_name)[0], target_name)
    drafter = load_drafter(drafter_dir, target)
    folder = export_drafter(
        drafter,
        target,
        pairs["output"],
        pairs["format"],
        target_name=target_name,
        num_speculative_tokens=int(gamma) if gamma else None,
    )
    print(f"wrote {folder} ({pairs['format']}); serve it with the command in {folder / 'README.md'}")
    if pairs.get("push_to_hub"):
        print(f"pushed: {push_to_hub(folder, pairs['push_to_hub'])}")
    return folder


def _trained_target(drafter_dir: Path) -> str:
    """The target the training job that wrote `drafter_dir` names in its config.yaml."""
    config = drafter_dir.parent / "config.yaml"
    if config.is_file():
        from omegaconf import OmegaConf

        name = OmegaConf.select(OmegaConf.load(config), "target.name")
        if name:
            return str(name)
    raise SystemExit(
        f"specdecode export: no target= given and no training config.yaml beside {str(drafter_dir)!r} names one"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """`specdecode <app> [args]`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    app, args = argv[0], argv[1:]
    if app in HYDRA_APPS:
        run_hydra_app(app, args)
    elif app == "report":
        report(args)
    elif app == "export":
        export(args)
    else:
        raise SystemExit(f"specdecode: unknown app {app!r}\n{USAGE}")


if __name__ == "__main__":
    main()
