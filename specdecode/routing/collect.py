"""router/collect.py: label the prompts of some domains and splits for every drafter, and write
the labels file with its meta sidecar (the format is `specdecode.routing.labels`)."""

from __future__ import annotations

import functools
import itertools
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode.core.atomic import write_atomic
from specdecode.core.devices import resolve_device
from specdecode.core.locking import check_writable
from specdecode.data.corpus import vocab_corpus
from specdecode.data.domains import format_prompt, prompts_within
from specdecode.data.example import Example
from specdecode.data.registry import domain_examples
from specdecode.decoding.decode import drafter_gamma
from specdecode.decoding.timing import measure_step_costs
from specdecode.models.compat import default_eos
from specdecode.models.feature_drafter import FeatureDrafter
from specdecode.models.loading import build_drafter, load_target, load_tokenizer
from specdecode.routing.config import CollectConfig
from specdecode.routing.labels import collect_labels, label_rows, meta_path


def run_collect(cfg: CollectConfig, *, progress: bool = True) -> Path:
    """Label the prompts of `cfg.domains` × `cfg.splits` for every drafter; write `cfg.output` and its
    `.meta.json` sidecar; return the labels' path."""
    check_writable(Path(cfg.output).parent, "output")
    torch.manual_seed(cfg.seed)
    _check_drafter_paths(cfg)
    for domain in cfg.domains:  # a missing file, column or malformed row fails before the target loads
        for split in cfg.splits:
            _examples(cfg, domain, split)
    check_domain_prompts(cfg, load_tokenizer(cfg.target))  # every domain gets labels, before the target loads
    target, tokenizer = load_target(
        cfg.target, dtype=cfg.dtype, device=resolve_device(cfg.device), skinny_matmul=cfg.skinny_matmul
    )
    examples = _prompts(cfg, tokenizer)
    # tokenised training text, only where a derived drafter picks its truncated vocabulary
    corpus = functools.partial(vocab_corpus, tokenizer, cfg.vocab_corpus_docs, cfg.data)
    drafters = [(d.name, build_drafter(d, target, tokenizer, corpus).eval()) for d in cfg.drafters]
    eos = default_eos(target)
    ids = [p for _, _, p in examples]
    gammas = {name: cfg.gamma or drafter_gamma(drafter) for name, drafter in drafters}
    labels = collect_labels(
        target,
        drafters,
        ids,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        eos_token_ids=eos,
        batch_size=cfg.batch_size,
        progress=progress,
        lookup=cfg.prompt_lookup,
        gammas=[gammas[name] for name, _ in drafters],
    )
    cost_ratios, verify_ratios, measured = _costs(cfg, target, drafters, gammas, ids, labels.continuations)
    rows = label_rows(
        labels,
        [(s, e) for s, e, _ in examples],
        [len(p) for p in ids],
        gammas=[gammas[n] for n in labels.drafters],
        cost_ratios=[cost_ratios[n] for n in labels.drafters],
        verify_ratios=[verify_ratios[n] for n in labels.drafters],
    )
    output = Path(cfg.output)
    write_atomic(output, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    meta = {
        "drafters": labels.drafters,
        "cost_ratios": cost_ratios,
        "verify_ratios": verify_ratios,
        "step_costs": measured,
        "gammas": gammas,
        "temperature": cfg.temperature,
        "label": "mean over the target's greedy continuation of Σ min(p, q) (acceptance) and "
        "1[argmax q = argmax p] (greedy_match), q one-hot where prompt lookup drafts (config.prompt_lookup); "
        "speedups by Leviathan Thm 3.8 with measured verify cost; greedy only: decode_tau, greedy "
        "decoding's tokens per target call simulated at each drafter's gamma, and decode_speedup, it over "
        "a pass's cost in target steps",
        "num_rows": len(rows),
        "config": asdict(cfg),
    }
    write_atomic(meta_path(output), json.dumps(meta, indent=2))
    return output


def _check_drafter_paths(cfg: CollectConfig) -> None:
    """A pretrained drafter given as a local path must exist: fail before the target loads."""
    for i, drafter in enumerate(cfg.drafters):
        text = str(drafter.path)
        local = text.startswith(("/", "./", "../", "~", "outputs/"))
        if drafter.kind == "pretrained" and local and not Path(text).expanduser().exists():
            raise ValueError(f"drafters[{i}].path={text!r} (drafter {drafter.name!r}) does not exist")


def _examples(cfg: CollectConfig, domain: str, split: str) -> list[Example]:
    return domain_examples(cfg.data[domain], split)  # type: ignore[arg-type]  # resolved data configs are DataConfigs


def check_domain_prompts(cfg: CollectConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """Every domain has a prompt within `max_prompt_tokens` in `cfg.splits` (else it would get no labels);
    a ValueError names the domain, its shortest prompt and the setting."""
    for domain in cfg.domains:
        lengths = [len(format_prompt(tokenizer, ex)) for split in cfg.splits for ex in _examples(cfg, domain, split)]
        if not any(0 < n <= cfg.max_prompt_tokens for n in lengths):
            shortest = min(lengths, default=0)
            raise ValueError(
                f"domain {domain!r}: none of its {len(lengths)} prompts (splits {cfg.splits}) fits "
                f"max_prompt_tokens={cfg.max_prompt_tokens} (its shortest has {shortest} tokens), so it would get "
                f"no router labels: set max_prompt_tokens to at least {shortest}"
            )


def _prompts(cfg: CollectConfig, tokenizer: PreTrainedTokenizerBase) -> list[tuple[str, Example, list[int]]]:
    """`(split, example, ids)` of the first prompts per split and domain that fit max_prompt_tokens."""
    chosen = []
    for split in cfg.splits:
        limit = cfg.train_limit if split == "train" else cfg.heldout_limit
        for domain in cfg.domains:
            fitting = prompts_within(tokenizer, _examples(cfg, domain, split), cfg.max_prompt_tokens)
            chosen += [(split, example, ids) for example, ids in itertools.islice(fitting, limit)]
    return chosen


def _costs(
    cfg: CollectConfig,
    target: PreTrainedModel,
    drafters: Sequence[tuple[str, PreTrainedModel | FeatureDrafter]],
    gammas: dict[str, int],
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
) -> tuple[dict[str, float], dict[str, float], dict[str, Any]]:
    """Cost ratio c per drafter and the verify ratio at its gamma: configured, or timed after the
    median-length prompt and its continuation."""
    measured: dict[str, Any] = {}
    if cfg.cost_ratios is None or cfg.verify_ratio is None:
        middle = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(continuations[i]))[len(prompts) // 2]
        context = list(prompts[middle]) + list(continuations[middle])
        longest = max(gammas.values())
        if len(context) <= longest + 1:
            context = ([t for p in prompts for t in p] * (longest + 2))[: 4 * (longest + 1)]
        measured = {
            name: measure_step_costs(target, drafter, context, gammas[name], cfg.cost_repeats).to_dict()
            for name, drafter in drafters
        }
    cost_ratios = cfg.cost_ratios or {name: costs["cost_ratio"] for name, costs in measured.items()}
    if cfg.verify_ratio is not None:
        verify_ratios = {name: cfg.verify_ratio for name, _ in drafters}
    else:
        # drafters at one gamma timed the same verify: each gamma gets their median
        by_gamma: dict[int, list[float]] = {}
        for name, costs in measured.items():
            by_gamma.setdefault(gammas[name], []).append(costs["verify_ratio"])
        verify_ratios = {name: statistics.median(by_gamma[gammas[name]]) for name, _ in drafters}
    return cost_ratios, verify_ratios, measured
