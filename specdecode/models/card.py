"""Model cards: the README.md of every saved or exported drafter folder (hub front matter, then
target, kind, data, budget, measurements and the command that reproduces it, also under
`specdecode:`), and `push_to_hub` for a folder when asked (`push_to_hub=<repo id>`).
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]  # PyYAML ships no type hints; its stubs are no dependency
from huggingface_hub import HfApi

from specdecode.core.atomic import write_atomic

CARD_FILE = "README.md"
# the hub ids of the embedded default target and of the embedded datasets' sources
HUB_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
EMBEDDED_DATASETS = {
    "code": ["openai/openai_humaneval"],
    "math": ["openai/gsm8k"],
    "chat": ["anon8231489123/ShareGPT_Vicuna_unfiltered"],
}


def command_line(argv: Iterable[str] | None = None) -> str:
    """The command that started this process (default `sys.orig_argv`), quoted for a shell:
    `python train/distill.py ...`, or `specdecode train ...` for the console command."""
    args = list(sys.orig_argv if argv is None else argv)[1:]  # without the interpreter's path
    if args[:2] == ["-m", "specdecode.pipeline.cli"]:
        return shlex.join(["specdecode", *args[2:]])
    if args and Path(args[0]).name == "specdecode":
        return shlex.join(["specdecode", *args[1:]])
    return shlex.join(["python", *args])


def training_facts(cfg: Any, metrics: Mapping[str, Any], command: str | None = None) -> dict[str, Any]:
    """The card's facts for a drafter trained by `specdecode.training.job` (`cfg`: its
    `TrainJobConfig`; `metrics`: what it wrote to metrics.json)."""
    data, drafter, train = cfg.data, cfg.drafter, cfg.train
    seconds = metrics.get("train_seconds") or 0.0
    # each measured figure, and in words what it was measured on
    measured: list[dict[str, Any]] = []

    def measure(metric: str, value: float, digits: int, on: str) -> None:
        measured.append({"metric": metric, "value": round(float(value), digits), "on": on})

    if metrics.get("acceptance_best") is not None:
        measure(
            "acceptance",
            metrics["acceptance_best"],
            4,
            f"{metrics.get('selection_metric', 'greedy acceptance')} of the drafter's next token "
            f"against the target's on {metrics.get('heldout_positions', '?')} positions of "
            f"{metrics.get('heldout_sequences', '?')} held-out "
            f"{data.name} sequences (training's model selection, step {metrics.get('best_step')})",
        )
    gamma = metrics.get("gamma") or {}
    if gamma.get("speedup") is not None:
        how = (
            f"timed batch-1 decodes of {gamma.get('prompts')} held-out prompts, "
            f"{gamma.get('max_new_tokens')} new tokens"
            if gamma.get("method") == "timed decodes"
            else str(gamma.get("method", ""))
        )
        chosen = gamma.get("chosen")
        measure("speedup", gamma["speedup"], 3, f"gamma {chosen} over target-only decoding, {how}, device {cfg.device}")
        tau = gamma.get("tau")
        tau = tau.get(chosen, tau.get(str(chosen))) if isinstance(tau, Mapping) else tau
        if tau is not None:
            measure("tau", tau, 3, f"tokens per target pass at gamma {chosen}, {how}")
    return {
        "target": cfg.target.name,
        "target_revision": getattr(cfg.target, "revision", None),
        "drafter": {
            "kind": drafter.kind,
            "num_layers": drafter.num_layers,
            "layout": drafter.layout,
            "feature_layers": metrics.get("feature_layers"),  # the target states it reads, as trained
            "draft_vocab": metrics.get("draft_vocab", drafter.draft_vocab),
            "init_from": drafter.path,
        },
        "data": {
            "domains": list(data.domain_names),
            "source": data.source,
            "synthetic": bool(data.synthetic),
            "path": data.path,
            "hf_id": data.hf_id,
            "revision": data.revision,
            "train_sequences": metrics.get("train_sequences"),
            "heldout_sequences": metrics.get("heldout_sequences"),
        },
        "training": {
            "job": metrics.get("job", cfg.name),
            "loss": metrics.get("loss"),
            "steps": metrics.get("steps"),
            "max_steps": train.max_steps,
            "max_minutes": train.max_minutes,
            "minutes": round(seconds / 60, 2),
            "train_tokens": metrics.get("train_tokens"),
            "device": cfg.device,
            "dtype": cfg.dtype,
            "processes": metrics.get("num_processes"),
            "gamma": gamma.get("chosen"),
        },
        "measured": measured,
        "command": command if command is not None else command_line(),
    }


# a drafter kind as the card's first line names it
KIND_NAMES = {
    "feature": "feature (EAGLE-style) drafter",
    "eagle3": "EAGLE-3 drafter",
    "derived": "drafter cut from the target's first layers",
    "pretrained": "drafter fine-tuned from a pretrained model",
}


def render_card(facts: Mapping[str, Any]) -> str:
    """A drafter folder's README.md from its facts (`training_facts`)."""
    target, drafter, data, training = facts["target"], facts["drafter"], facts["data"], facts["training"]
    domains = data["domains"]
    meta: dict[str, Any] = {"library_name": "transformers", "pipeline_tag": "text-generation"}
    meta["tags"] = [
        "specdecode",
        "speculative-decoding",
        "draft-model",
        *({"feature": ["eagle"], "eagle3": ["eagle3"]}.get(drafter["kind"], [])),
        *domains,
    ]
    if datasets := _datasets(data):
        meta["datasets"] = datasets
    meta["specdecode"] = dict(facts)
    revision = f" at revision `{facts['target_revision']}`" if facts.get("target_revision") else ""
    kind = KIND_NAMES.get(drafter["kind"], f"{drafter['kind']} drafter")
    vocab = drafter["draft_vocab"]
    lines = [
        *_front_matter(target, meta),
        f"# {'/'.join(domains)} drafter for {target}",
        "",
        f"A {kind} for speculative decoding with `{target}`{revision}, trained by specdecode on "
        f"{'/'.join(domains)} data. Decoding with it is exact: the target verifies every drafted token.",
        "",
        "## Drafter",
        "",
        "| kind | layers | layout | target states read | draft vocabulary |",
        "|---|---|---|---|---|",
        f"| {drafter['kind']} | {drafter['num_layers']} | {drafter.get('layout') or ''} | "
        f"{drafter.get('feature_layers') or ''} | {vocab if vocab else 'full'} |",
        "",
        "## Data",
        "",
        f"Domains {', '.join(domains)}; source `{data['source']}`"
        + (" (synthetic smoke examples)" if data.get("synthetic") else "")
        + (f", file `{data['path']}`" if data.get("path") else "")
        + (f", hub dataset `{data['hf_id']}`" if data.get("hf_id") else "")
        + f"; {data.get('train_sequences')} training and {data.get('heldout_sequences')} held-out sequences.",
        "",
        "## Training",
        "",
        f"{training['job']} ({training.get('loss')}), {training['steps']} steps in {training['minutes']} minutes "
        f"(budget: {training['max_steps']} steps"
        + (f" or {training['max_minutes']} minutes" if training.get("max_minutes") else "")
        + f"), {training.get('train_tokens')} training tokens, on {training['device']} ({training['dtype']}, "
        f"{training.get('processes') or 1} process(es))."
        + (f" Chosen gamma: {training['gamma']}." if training.get("gamma") else ""),
        "",
        "## Measured",
        "",
    ]
    if facts["measured"]:
        lines += ["| metric | value | on |", "|---|---|---|"]
        lines += [f"| {m['metric']} | {m['value']} | {m['on']} |" for m in facts["measured"]]
    else:
        lines.append("Nothing measured yet.")
    lines += [
        "",
        "## Reproduce",
        "",
        "```bash",
        facts["command"],
        "```",
        "",
        "The resolved configuration is `config.yaml` beside this folder.",
        "",
        "## Use",
        "",
        "```python",
        "from specdecode import speculative_generate",
        "from specdecode.models import load_model",
        "",
        f"target, tokenizer = load_model({target!r})",
        'drafter, _ = load_model("<this folder>")',
        'result = speculative_generate(target, drafter, [tokenizer.encode("def add(a, b):")], max_new_tokens=64)',
        "```",
        "",
    ]
    if (formats := _export_formats(drafter)) is not None:
        lines += [
            f"To serve it with vLLM or SGLang: `specdecode export drafter=<this folder> format={formats} "
            "output=<folder>`.",
            "",
        ]
    return "\n".join(lines)


def _export_formats(drafter: Mapping[str, Any]) -> str | None:
    """The export formats a trained drafter of the card's `drafter` facts can be written in, or None."""
    if drafter["kind"] == "eagle3":
        return "vllm-eagle3|sglang-eagle3"
    if drafter["kind"] == "feature" and drafter.get("layout") == "eagle":
        return "vllm-eagle|sglang-eagle"
    return None


def write_training_card(folder: str | Path, cfg: Any, metrics: Mapping[str, Any], command: str | None = None) -> Path:
    """Write `folder`/README.md for a drafter the training job saved there; return its path."""
    path = Path(folder) / CARD_FILE
    write_atomic(path, render_card(training_facts(cfg, metrics, command)))
    return path


def export_card(
    format: str,
    engine: str,
    method: str,
    config: Mapping[str, Any],
    target_name: str | None,
    folder: Path,
    gamma: int,
    hot_token_map: bool,
) -> str:
    """README.md of an exported folder: what it is and the command that serves it."""
    target = target_name or "<target>"
    tags = ["specdecode", "speculative-decoding", "eagle3" if "eagle3" in format else "eagle", engine]
    if engine == "vllm":
        spec = '{"method": "%s", "model": "%s", "num_speculative_tokens": %d}' % (method, folder, gamma)
        serve = f"vllm serve {target} --speculative-config '{spec}'"
    else:
        serve = (
            f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {method} "
            f"--speculative-draft-model-path {folder} --speculative-num-steps {gamma} --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens {gamma + 1}"
        )
        if hot_token_map:
            serve += f" --speculative-token-map {folder}/hot_token_map.pt"
    return "\n".join(
        [
            *_front_matter(target_name, {"library_name": engine, "tags": tags}),
            f"# {format} draft model for {target}",
            "",
            f"A specdecode feature drafter written in {engine}'s {method} draft-model format "
            f"(`{config.get('architectures', [''])[0]}`, {config.get('num_hidden_layers')} layer(s)). "
            "specdecode checked it against a re-implementation of the engine's loader and forward, not in the engine.",
            "",
            "```bash",
            serve,
            "```",
            "",
        ]
    )


def hub_id(name: str | None) -> str | None:
    """`name` as a hub model id if it is one (or an alias of one), else None (a local path, `smoke`)."""
    if not name:
        return None
    name = HUB_IDS.get(name, name)
    if name.count("/") != 1 or name.startswith((".", "/", "~")) or Path(name).exists():
        return None
    return name


def _front_matter(target: str | None, meta: Mapping[str, Any]) -> list[str]:
    """A card's first lines: `target`'s hub id (if it has one) as `base_model`, then `meta`, as the
    hub's YAML front matter."""
    base = hub_id(target)
    front = ({"base_model": base} if base is not None else {}) | dict(meta)
    return ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", ""]


def is_repo_id(value: object) -> bool:
    """`value` is a hub repo id, `owner/name`."""
    return isinstance(value, str) and value.count("/") == 1 and all(value.split("/"))


def _datasets(data: Mapping[str, Any]) -> list[str]:
    if data.get("synthetic"):
        return []
    if data.get("hf_id"):
        return [data["hf_id"]]
    if data.get("source") == "embedded":
        return [d for domain in data["domains"] for d in EMBEDDED_DATASETS.get(domain, [])]
    return []


def push_to_hub(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = True,
    token: str | None = None,
    api: HfApi | None = None,
) -> str:
    """Upload `folder` (a drafter or an export, card included) to the hub repo `repo_id`, created
    if missing (private unless asked); returns the commit's URL. A ValueError names a folder
    without a card or a `repo_id` that is not `owner/name`."""
    folder = Path(folder)
    if not (folder / CARD_FILE).is_file():
        raise ValueError(f"push_to_hub: {str(folder)!r} is not a folder with a {CARD_FILE} model card")
    if not is_repo_id(repo_id):
        raise ValueError(f"push_to_hub={repo_id!r}: expected a hub repo id 'owner/name'")
    api = api if api is not None else HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    commit = api.upload_folder(
        folder_path=str(folder),
        repo_id=repo_id,
        repo_type="model",
        commit_message=f"specdecode drafter from {folder.name}",
    )
    return str(getattr(commit, "commit_url", commit))
