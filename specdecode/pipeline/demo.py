"""The main job (`make demo`): benchmark → distill the generic drafter, each domain's drafter and the
all-data control → router labels → router fit → evaluation, each stage cached by its resolved
config and the code, composed from conf/ as the individual commands compose it.
"""

from __future__ import annotations

import copy
import importlib
import json
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specdecode.core.atomic import write_atomic
from specdecode.core.config import from_dict
from specdecode.core.devices import resolve_device
from specdecode.core.locking import locks_output_dir
from specdecode.data.config import DataConfig, to_dict
from specdecode.data.registry import resolve_domains
from specdecode.evaluation.config import BenchmarkConfig, EvalConfig
from specdecode.evaluation.control import control_comparison, control_section
from specdecode.evaluation.report import markdown_table, rebase_links
from specdecode.models.config import DrafterConfig
from specdecode.pipeline.config import DemoConfig, accelerate_config_file
from specdecode.pipeline.launch import launch_app, map_strings
from specdecode.pipeline.schemas import compose_config
from specdecode.pipeline.stages import Stage, code_fingerprint, run_stages
from specdecode.routing.config import CollectConfig, FitRouterConfig
from specdecode.training.config import TrainConfig, TrainJobConfig
from specdecode.training.sequences import domain_limit, domain_parts, mix_limit, pool_size
from specdecode.watch.watcher import demo_drafter_dir


def _launched(app: str, accelerate: str, device: str) -> Callable[[dict, Path], None]:
    """A stage that runs `accelerate launch <app's script>` on its config, writing into `out`."""

    def run(config: dict, out: Path) -> None:
        launch_app(app, config | {"output_dir": str(out)}, accelerate_config_file(accelerate, device), out / "hydra")

    return run


def _in_process(stage: str) -> Callable[[dict, Path], None]:
    """A stage that runs its app's function (`_SCHEMAS`) in this process on its typed config, writing into `out`."""
    schema, output_key, file_name, function = _SCHEMAS[stage]

    def run(config: dict, out: Path) -> None:
        module, _, name = function.partition(":")
        getattr(importlib.import_module(module), name)(from_dict(schema, config | {output_key: str(out / file_name)}))

    return run


def _mix_config(config: dict[str, Any]) -> dict[str, Any]:
    """The generic drafter's job config: its domains' data configs resolved into it and its sequence
    limits the domain jobs' own, summed (`mix_limit`), so it reads exactly their cached sequences."""
    per_domain, limit = config["train"]["train_sequences_per_domain"], config["train"]["train_sequences"]
    if any(n is not None for n in per_domain.values()) and limit is not None:
        # a mix's train_sequences caps its total: each domain's share is named instead
        config["train"]["train_sequences_per_domain"] = {
            d: limit if per_domain.get(d) is None else per_domain[d] for d in config["data"]["domains"]
        }
    data = from_dict(DataConfig, config["data"])
    config["data"] = to_dict(data)
    train = from_dict(TrainConfig, config["train"])
    for key, split in (("train_sequences", "train"), ("heldout_sequences", "heldout")):
        if config["train"][key] is not None:
            config["train"][key] = mix_limit(data, train, split, config["train"][key])
    return config


def _alldata_config(mix: dict[str, Any], jobs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The all-data control's job config: the generic drafter's (`mix`, before its limits are set)
    reading each domain job's training sequences, for the summed budget of `jobs`."""
    train = mix["train"]
    train["train_sequences_per_domain"] = {
        name: domain_limit(from_dict(TrainConfig, job["train"]), name, "train", job["train"]["train_sequences"])
        for name, job in jobs.items()
        if name != "mix"
    }
    train["train_sequences"] = None  # each domain's share is named: no cap on their sum
    for key in ("max_steps", "max_minutes"):
        budgets = [job["train"][key] for job in jobs.values()]
        train[key] = None if None in budgets else sum(budgets)
    return _mix_config(mix)


def _drafter_stages(
    cfg: DemoConfig,
    composed: Callable[[str, list[str]], dict[str, Any]],
    distill: Callable[[dict, Path], None],
    control: bool,
) -> list[Stage]:
    """The distillation stages in training order: the generic drafter's (`distill-mix`) and each
    domain's (fine-tuned from the generic one, or first), then with `control` the all-data control's."""
    stages: list[Stage] = []
    mix: dict[str, Any] = {}
    from_generic = cfg.specialists_from == "generic"
    generic_dir = str(demo_drafter_dir(Path(cfg.output_dir), "generic"))
    for name in ("mix", *cfg.domains) if from_generic else (*cfg.domains, "mix"):
        mix_domains = [f"data.domains=[{','.join(cfg.domains)}]"] if name == "mix" else []
        overrides = [f"data={name}", *mix_domains, f"loss={cfg.loss(name)}", *cfg.distill]
        config = composed("distill", [*overrides, *cfg.distill_per_domain.get(name, [])])
        after: list[str] = []
        if name != "mix" and from_generic:
            config["drafter"] = asdict(DrafterConfig(kind="pretrained", path=generic_dir, draft_vocab=None))
            after = ["distill-mix"]
        if name == "mix":
            mix = copy.deepcopy(config)
            config = _mix_config(config)
        stages.append(Stage(f"distill-{name}", config, distill, after=after))
    if control:
        jobs = {s.name.removeprefix("distill-"): s.config for s in stages}
        stages.append(Stage("distill-alldata", _alldata_config(mix, jobs), distill))
    return stages


def demo_stages(cfg: DemoConfig) -> list[Stage]:
    """The stages in dependency order. The wiring between them is set on the composed configs, never
    spliced into override strings (a path may hold quotes, commas or `${`)."""
    root = Path(cfg.output_dir)
    launched = cfg.launcher == "accelerate"
    distill = _launched("distill", cfg.accelerate_config, cfg.device) if launched else _in_process("distill")
    evaluate = _launched("eval", cfg.accelerate_config, cfg.device) if launched else _in_process("eval")
    placement = {"device": cfg.device, "dtype": cfg.dtype, "skinny_matmul": cfg.skinny_matmul}

    def composed(stage: str, overrides: list[str]) -> dict[str, Any]:
        return compose_config(cfg.configs[stage], overrides) | placement

    # Each domain's data config from this app's search path: an unknown domain fails before any stage.
    data = resolve_domains(cfg.domains)
    evaluation = composed("eval", list(cfg.eval))
    # gamma is declared once, by the evaluation (null or auto there: the others keep their own).
    gamma = {"gamma": evaluation["gamma"]} if isinstance(evaluation["gamma"], int) else {}
    stages: list[Stage] = []
    if cfg.run_benchmark:
        stages.append(Stage("benchmark", composed("benchmark", list(cfg.benchmark)) | gamma, _in_process("benchmark")))
    short = composed("eval", [*cfg.eval, *cfg.short_eval]) if cfg.short_eval else None
    control = any("alldata" in e["methods"] for e in (evaluation, short) if e is not None)
    trained = _drafter_stages(cfg, composed, distill, control)
    stages += trained
    # the router and the evaluation list the drafters in one order; the evaluation also has the control
    drafter_dirs = {d: str(demo_drafter_dir(root, d)) for d in (*cfg.domains, "generic")}
    evaluated = drafter_dirs | ({"alldata": str(root / "distill-alldata" / "drafter")} if control else {})
    distills = [s.name for s in trained if s.name != "distill-alldata"]

    def wired(config: dict[str, Any]) -> dict[str, Any]:
        return config | {
            "drafters": config["drafters"] | evaluated,
            "router_dir": str(root / "fit"),
            "domains": list(cfg.domains),
            "data": data,
        }

    evaluation = wired(evaluation)
    drafters = [{"name": n, "kind": "pretrained", "path": p} for n, p in drafter_dirs.items()]
    collect = composed("collect", list(cfg.collect)) | {"drafters": drafters, "domains": list(cfg.domains)} | gamma
    collect["data"] = data
    stages.append(Stage("collect", collect, _in_process("collect"), after=distills))
    fit = composed("fit", list(cfg.fit)) | {"labels": str(root / "collect" / "labels.jsonl")}
    stages.append(Stage("fit", fit, _in_process("fit"), after=["collect"]))
    after = [*(s.name for s in trained), "fit"]
    stages.append(Stage("eval", evaluation, evaluate, after=after))
    if short is not None:
        stages.append(Stage("eval-short", wired(short), evaluate, after=after))
    return stages


# Each stage's typed config, the key and file name its output goes in, and the function that runs it.
_SCHEMAS: dict[str, tuple[type, str, str, str]] = {
    "benchmark": (BenchmarkConfig, "output_dir", "", "specdecode.evaluation.benchmark:run_benchmark"),
    "distill": (TrainJobConfig, "output_dir", "", "specdecode.training.job:run_distill"),
    "collect": (CollectConfig, "output", "labels.jsonl", "specdecode.routing.collect:run_collect"),
    "fit": (FitRouterConfig, "output_dir", "", "specdecode.routing.fit:run_fit"),
    "eval": (EvalConfig, "output_dir", "", "specdecode.evaluation.suite:run_eval"),
}


def check_stage_configs(stages: list[Stage], root: Path) -> None:
    """Build every stage's typed config before any stage runs, so that a bad override fails in seconds
    (a ValueError naming the stage), not after the stages before it. Folders that earlier stages
    write stand in as `root`'s parent, which exists."""

    def stand_in(value: str) -> str:
        return str(root.parent) if Path(value).is_relative_to(root) and not Path(value).suffix else value

    typed: dict[str, Any] = {}
    for stage in stages:
        schema, output_key, file_name, _ = _SCHEMAS[stage.name.split("-")[0]]
        try:
            config = map_strings(stage.config, stand_in) | {output_key: str(root / stage.name / file_name)}
            typed[stage.name] = from_dict(schema, config)
        except ValueError as error:
            raise ValueError(f"demo stage {stage.name!r}: {error}") from None
    check_stage_inputs(typed)


def check_stage_inputs(configs: dict[str, Any]) -> None:
    """What a later stage would fail on with the data at hand (enough examples and prompts within its
    limits), checked before the first stage; a ValueError names the stage and the demo key that sets it."""
    from specdecode.evaluation.suite import check_heldout_prompts
    from specdecode.models.loading import load_tokenizer
    from specdecode.routing.collect import check_domain_prompts

    tokenizers: dict[str, Any] = {}

    def tokenizer(config: Any) -> Any:
        if config.target.name not in tokenizers:
            tokenizers[config.target.name] = load_tokenizer(config.target)
        return tokenizers[config.target.name]

    demo_key = {"distill": "distill", "collect": "collect", "eval": "eval", "eval-short": "short_eval"}
    for name, config in configs.items():
        kind = name.split("-")[0]
        try:
            if kind == "distill":
                for part in domain_parts(config.data):
                    for split in ("train", "heldout"):
                        pool_size(part, config.train, split)
            elif kind == "collect":
                check_domain_prompts(config, tokenizer(config))
            elif kind == "eval":
                check_heldout_prompts(config, tokenizer(config))
        except ValueError as error:
            key = demo_key.get(name, demo_key.get(kind))
            where = f" (the demo sets it in `{key}`)" if key else ""
            raise ValueError(f"demo stage {name!r}: {error}{where}") from None


@locks_output_dir
def run_demo(cfg: DemoConfig) -> Path:
    """Run (or resume) the demo; publish results.json and report.md at the top of `output_dir`."""
    resolve_device(cfg.device)  # a device this machine lacks fails here, before any stage runs
    root = Path(cfg.output_dir)
    stages = demo_stages(cfg)
    check_stage_configs(stages, root)
    outputs = run_stages(stages, root, code_fingerprint())
    evaluation = outputs["eval"]
    for png in evaluation.glob("*.png"):
        shutil.copy2(png, root / png.name)
    results = json.loads((evaluation / "results.json").read_text())
    results["stages"] = {name: str(path) for name, path in outputs.items()}
    comparison = control_comparison(results)
    if comparison is not None:
        results["control"] = comparison
        results["default_drafter"] = comparison["default_drafter"]
    if "eval-short" in outputs:
        short = json.loads((outputs["eval-short"] / "results.json").read_text())
        results["short_eval"] = {"config": short["config"], "rows": short["rows"]}
    write_atomic(root / "results.json", json.dumps(results, indent=2))
    report = [rebase_links((evaluation / "report.md").read_text(), evaluation, root)]
    if comparison is not None:
        report += control_section(comparison, str(outputs["distill-alldata"] / "drafter"))
    if "eval-short" in outputs:
        tokens = results["short_eval"]["config"]["max_new_tokens"]
        report += ["", f"## The same drafters at {tokens} new tokens (stage `eval-short`)", ""]
        report.append(markdown_table(results["short_eval"]["rows"]))
    for name, title in (("benchmark", "Decode benchmark"), ("fit", "Router")):
        if name in outputs and (outputs[name] / "report.md").is_file():
            text = rebase_links((outputs[name] / "report.md").read_text(), outputs[name], root)
            report += ["", f"## {title} (stage `{name}`)", "", text]
    report += [
        "",
        "## Distillation (held-out acceptance by each job's selection metric; greedy: argmax agreement)",
        "",
        "| drafter | kind | loss | selection metric | before | best | gain | steps | epochs | train min | stored gamma "
        "| train tokens/s | peak memory MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, path in outputs.items():
        metrics_path = path / "metrics.json"
        if name.startswith("distill-") and metrics_path.is_file():
            m = json.loads(metrics_path.read_text())
            report.append(
                f"| {name.removeprefix('distill-')} | {m['drafter_kind']} | {m['loss']} | {m['selection_metric']} | "
                f"{m['acceptance_before']:.3f} | "
                f"{m['acceptance_best']:.3f} | {m['acceptance_gain']:+.3f} | {m['steps']} | {m['epochs']:.1f} | "
                f"{m['train_seconds'] / 60:.1f} | {(m.get('gamma') or {}).get('chosen', '–')} | "
                f"{m['train_tokens_per_s']:.0f} | {m['peak_memory_mb']:.0f} |"
            )
    write_atomic(root / "report.md", "\n".join(report) + "\n")
    return root
