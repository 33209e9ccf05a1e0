"""The main job on the embedded default: benchmark → distill the generic drafter on the mix and each
domain's drafter (from scratch, or fine-tuned from the generic one), and the all-data control → router
labels → router fit → evaluation, each stage cached by its resolved config and the code (`make demo`).
The report then says whether routing beat the control (`specdecode.evaluation.control`).

Every stage's config is composed from the checked-in YAML under conf/ with the demo's overrides,
so the demo runs exactly what the individual commands run, and its cache key is that config.
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
from specdecode.pipeline.launch import launch_app
from specdecode.pipeline.schemas import compose_config
from specdecode.pipeline.stages import Stage, code_fingerprint, run_stages
from specdecode.routing.config import CollectConfig, FitRouterConfig
from specdecode.training.config import TrainConfig, TrainJobConfig
from specdecode.training.sequences import domain_limit, domain_parts, mix_limit, pool_size


def _launched(app: str, accelerate: str, device: str) -> Callable[[dict, Path], None]:
    """A stage that runs `accelerate launch <app's script>` on its config, writing into `out`."""

    def run(config: dict, out: Path) -> None:
        launch_app(app, config | {"output_dir": str(out)}, accelerate_config_file(accelerate, device), out / "hydra")

    return run


def _in_process(stage: str) -> Callable[[dict, Path], None]:
    """A stage that runs its app's function (`_SCHEMAS`, imported when it runs) in this process on its
    typed config, writing into `out`."""
    schema, output_key, file_name, function = _SCHEMAS[stage]

    def run(config: dict, out: Path) -> None:
        module, _, name = function.partition(":")
        getattr(importlib.import_module(module), name)(from_dict(schema, config | {output_key: str(out / file_name)}))

    return run


def _mix_config(config: dict[str, Any]) -> dict[str, Any]:
    """The generic drafter's job config: its domains' data configs resolved into it and its
    sequence limits set to read exactly the domain jobs' caches."""
    # A mix's sequences are its domains' cached ones (specdecode.training.sequences.domain_parts):
    # trained first, the generic drafter writes them and the domain jobs read them. Its limit is
    # the domain jobs' own, summed over domains as they cap it (`mix_limit`), so a domain with
    # fewer examples than the limit does not shift every domain's share and miss their caches.
    per_domain, limit = config["train"]["train_sequences_per_domain"], config["train"]["train_sequences"]
    if any(n is not None for n in per_domain.values()) and limit is not None:
        # a mix's train_sequences caps its total: each domain's share is named instead
        config["train"]["train_sequences_per_domain"] = {
            d: limit if per_domain.get(d) is None else per_domain[d] for d in config["data"]["domains"]
        }
    # its domains' data configs, resolved here (the demo's config search path) into its config
    data = from_dict(DataConfig, config["data"])
    config["data"] = to_dict(data)
    train = from_dict(TrainConfig, config["train"])
    for key, split in (("train_sequences", "train"), ("heldout_sequences", "heldout")):
        if config["train"][key] is not None:
            config["train"][key] = mix_limit(data, train, split, config["train"][key])
    return config


def _alldata_config(mix: dict[str, Any], jobs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The all-data control's job config: the generic drafter's (`mix`, as composed, before its
    limits are set) reading each domain job's training sequences (their caches), for the summed
    budget (`max_steps`, `max_minutes`) of `jobs` (the generic one under `mix`, and the domain
    jobs by domain): the data and minutes of the drafters routing chooses between, in one drafter."""
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
    domain's (first, or fine-tuned from the generic one after it), then, with `control`, the
    all-data control's (`distill-alldata`), after the domain jobs whose cached sequences it reads.
    `composed(app, overrides)` is an app's config as the demo composes it."""
    stages: list[Stage] = []
    mix: dict[str, Any] = {}
    from_generic = cfg.specialists_from == "generic"
    generic_dir = str(Path(cfg.output_dir) / "distill-mix" / "drafter")
    for name in ("mix", *cfg.domains) if from_generic else (*cfg.domains, "mix"):
        mix_domains = [f"data.domains=[{','.join(cfg.domains)}]"] if name == "mix" else []
        config = composed(
            "distill",
            [
                f"data={name}",
                *mix_domains,
                f"loss={cfg.loss(name)}",
                *cfg.distill,
                *cfg.distill_per_domain.get(name, []),
            ],
        )
        after: list[str] = []
        if name != "mix" and from_generic:
            # Fine-tuned from the generic drafter (any kind: a pretrained folder keeps its own).
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
    """The stages in dependency order. Paths between stages point at final stage folders.

    The wiring between stages (the device and dtype, paths under output_dir, the domains, gamma)
    is set on the composed configs, never spliced into override strings: a path may hold quotes,
    commas or `${`.
    """
    root = Path(cfg.output_dir)
    # Training and evaluation go through `accelerate launch` (the launcher users type; several
    # processes where the accelerate config asks for them); the other stages are single-process.
    launched = cfg.launcher == "accelerate"
    distill = _launched("distill", cfg.accelerate_config, cfg.device) if launched else _in_process("distill")
    evaluate = _launched("eval", cfg.accelerate_config, cfg.device) if launched else _in_process("eval")
    placement = {"device": cfg.device, "dtype": cfg.dtype, "skinny_matmul": cfg.skinny_matmul}

    def composed(stage: str, overrides: list[str]) -> dict[str, Any]:
        return compose_config(cfg.configs[stage], overrides) | placement

    # Each domain's data config, from this app's config search path (the user's conf/data/ too):
    # an unknown or clashing domain fails here, before any stage runs.
    data = resolve_domains(cfg.domains)
    evaluation = composed("eval", list(cfg.eval))
    # gamma is declared once, by the evaluation: the benchmark and the router's speedup labels
    # describe the setting the evaluation runs (null or auto there: they keep their own).
    gamma = {"gamma": evaluation["gamma"]} if isinstance(evaluation["gamma"], int) else {}
    stages: list[Stage] = []
    if cfg.run_benchmark:
        stages.append(Stage("benchmark", composed("benchmark", list(cfg.benchmark)) | gamma, _in_process("benchmark")))
    short = composed("eval", [*cfg.eval, *cfg.short_eval]) if cfg.short_eval else None
    control = any("alldata" in e["methods"] for e in (evaluation, short) if e is not None)
    trained = _drafter_stages(cfg, composed, distill, control)
    stages += trained
    # the router and the evaluation list the drafters in one order, whichever trained first; the
    # evaluation also has the control, which the router does not choose
    drafter_dirs = {
        d: str(root / f"distill-{'mix' if d == 'generic' else d}" / "drafter") for d in (*cfg.domains, "generic")
    }
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


# Each stage's typed config, the key and file name (under the stage's folder, "" for the folder
# itself) its output goes in, and the `module:function` that runs it in this process.
_SCHEMAS: dict[str, tuple[type, str, str, str]] = {
    "benchmark": (BenchmarkConfig, "output_dir", "", "specdecode.evaluation.benchmark:run_benchmark"),
    "distill": (TrainJobConfig, "output_dir", "", "specdecode.training.job:run_distill"),
    "collect": (CollectConfig, "output", "labels.jsonl", "specdecode.routing.collect:run_collect"),
    "fit": (FitRouterConfig, "output_dir", "", "specdecode.routing.fit:run_fit"),
    "eval": (EvalConfig, "output_dir", "", "specdecode.evaluation.suite:run_eval"),
}


def check_stage_configs(stages: list[Stage], root: Path) -> None:
    """Build every stage's typed config before any stage runs, so a bad override fails in seconds
    (ValueError naming the stage and the value), not after the stages before it: a demo run once
    reached its evaluation after 55 minutes and failed on the evaluation's overrides there.
    Folders under `root` that earlier stages write (drafters, the router) stand in as `root`'s
    parent, which exists: their existence is the one check that has to wait for those stages
    (files keep their names, whose suffixes are checked)."""

    def stand_in(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: stand_in(v) for k, v in value.items()}
        if isinstance(value, list):
            return [stand_in(v) for v in value]
        if isinstance(value, str) and Path(value).is_relative_to(root) and not Path(value).suffix:
            return str(root.parent)
        return value

    typed: dict[str, Any] = {}
    for stage in stages:
        schema, output_key, file_name, _ = _SCHEMAS[stage.name.split("-")[0]]
        try:
            typed[stage.name] = from_dict(
                schema, stand_in(stage.config) | {output_key: str(root / stage.name / file_name)}
            )
        except ValueError as error:
            raise ValueError(f"demo stage {stage.name!r}: {error}") from None
    check_stage_inputs(typed)


def check_stage_inputs(configs: dict[str, Any]) -> None:
    """What a later stage would fail on with the data at hand, checked before the first stage
    (with the target's tokenizer, not its weights): each domain's training examples have the
    responses its job's settings train on; every domain has a prompt within the router labels'
    `max_prompt_tokens`, and `prompts_per_domain` held-out prompts within the evaluation's.

    Raises ValueError: naming the stage, the domain and the setting to change, and the demo key
    (`distill_per_domain`, `collect`, `eval`, `short_eval`) that sets it.
    """
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
    """Run (or resume) the demo; publish results.json and report.md at the top of `output_dir`.

    Raises ValueError: a stage's composed config is invalid (checked before any stage runs).
    """
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
    # Routing against the all-data control: the default drafter is whichever is accepted more often.
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
