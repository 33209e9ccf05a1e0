"""The decode benchmark, two ways over one set of methods, timing loop and report: `run_benchmark`
(one configured drafter, eager, with the step costs and the speedup Leviathan's model predicts) and
`run_core_benchmark` (the cores side by side per target, dtype and batch size, and the data writer).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from specdecode.core.atomic import write_atomic
from specdecode.core.devices import resolve_device
from specdecode.core.locking import check_writable
from specdecode.data.corpus import vocab_corpus
from specdecode.decoding.adaptive import AdaptiveGamma
from specdecode.decoding.decode import adaptive_gamma, autoregressive_generate, speculative_generate
from specdecode.decoding.sampling import SamplingParams
from specdecode.decoding.speedup import predicted_speedup
from specdecode.decoding.static_cache import static_capacity
from specdecode.decoding.timing import StepCosts, core_step_costs, measure_step_costs, measure_verify_ratios
from specdecode.evaluation.benchmark_methods import (
    Drafter,
    Row,
    check_only,
    data_writers,
    drafters_of,
    methods,
    time_group,
)
from specdecode.evaluation.benchmark_report import benchmark_results, costs_markdown, format_row, report_markdown
from specdecode.evaluation.benchmark_targets import benchmark_prompts, build_target
from specdecode.evaluation.config import BenchmarkConfig
from specdecode.evaluation.profiling import profile_group
from specdecode.models.compat import default_eos
from specdecode.models.cpu_matmul import skinny_rows_of
from specdecode.models.loading import build_drafter, load_target, resolve_dtype

# The gammas whose verify cost `run_benchmark` reports (a pass of gamma + 1 tokens).
VERIFY_GAMMAS = tuple(range(1, 9))


def run_benchmark(cfg: BenchmarkConfig) -> dict:
    """Run the benchmark of `cfg`; write `results.json` and `report.md` under `cfg.output_dir`."""
    check_writable(Path(cfg.output_dir))
    torch.manual_seed(cfg.seed)
    target, tokenizer = load_target(
        cfg.target, dtype=cfg.dtype, device=resolve_device(cfg.device), skinny_matmul=cfg.skinny_matmul
    )
    drafter = build_drafter(cfg.drafter, target, tokenizer, lambda: vocab_corpus(tokenizer, cfg.vocab_corpus_docs))
    prompts = benchmark_prompts(tokenizer, cfg.num_prompts, cfg.max_prompt_tokens)
    ids = [p for _, p in prompts]
    costs = _step_costs(cfg, target, drafter, ids)
    adaptive = adaptive_gamma(target, drafter, SamplingParams(cfg.temperature))  # timed once per machine
    rows = _rows(cfg, target, drafter, adaptive, ids)
    ours, assisted = rows[1], next((r for r in rows if r.method == "transformers assisted"), None)  # batch 1
    ours.predicted_speedup = predicted_speedup(ours.alpha or 0.0, cfg.gamma, costs.cost_ratio, costs.verify_ratio)
    ours.loop_efficiency = (ours.speedup or 0.0) / ours.predicted_speedup
    results = benchmark_results(rows, str(target.device)) | {
        "config": asdict(cfg),
        "prompts": [{"domain": d, "tokens": len(p)} for d, p in prompts],
        "step_costs": costs.to_dict(),
        # seconds of a whole step per batch size and gamma (0: the target alone), as gamma auto chose from
        "step_table": adaptive.costs.to_dict(),
        "ours_vs_transformers_assisted": ours.tokens_per_s / assisted.tokens_per_s if assisted else None,
    }
    # the CPU kernel in use: the row counts computed as weight @ x.T, null where F.linear does all
    results["machine"]["skinny_rows"] = skinny_rows_of(target)
    out = Path(cfg.output_dir)
    write_atomic(out / "results.json", json.dumps(results, indent=2))
    write_atomic(out / "report.md", report_markdown(results))
    return results


def _rows(
    cfg: BenchmarkConfig, target: PreTrainedModel, drafter: Drafter, adaptive: AdaptiveGamma, ids: list[list[int]]
) -> list[Row]:
    """Each method at batch 1 (one prompt at a time), then at batch B, against the target alone."""
    rows: list[Row] = []
    for prompts, batch_size in ((ids[: cfg.batch1_prompts], 1), (ids[: cfg.batch_size], cfg.batch_size)):
        found = methods(
            target,
            cfg.gamma,
            cfg.max_new_tokens,
            batch_size,
            {"drafter": drafter},
            cores=("eager",),
            auto={"drafter": adaptive},
            eos=default_eos(target),
            prompt_lookup=cfg.prompt_lookup,
            temperature=cfg.temperature,
            seed=cfg.seed,
        )
        found = {_label(name): m for name, m in found.items() if cfg.hf_assisted or "transformers" not in name}
        measured = time_group(found, prompts, batch_size, cfg.rounds, print, reference=lambda name: "target alone")
        rows += [Row(cfg.target.name, cfg.dtype, batch_size, name, **m) for name, m in measured.items()]
    return rows


def _label(name: str) -> str:
    """`run_benchmark`'s name of a method: it times one drafter, on the eager core, and calls ours `specdecode`."""
    return name.removesuffix(", eager").replace("ours (drafter)", "specdecode").replace(" (drafter)", "")


def _step_costs(cfg: BenchmarkConfig, target: PreTrainedModel, drafter: Drafter, ids: list[list[int]]) -> StepCosts:
    """After a warm-up, the step costs mid-answer, and what a verify of 2..9 tokens costs there."""
    decode: dict[str, Any] = dict(
        max_new_tokens=8, temperature=cfg.temperature, eos_token_ids=default_eos(target), seed=cfg.seed
    )
    speculative_generate(target, drafter, ids[:1], gamma=cfg.gamma, prompt_lookup=cfg.prompt_lookup, **decode)
    autoregressive_generate(target, ids[:1], **decode)
    context = ids[0] + ids[1][: cfg.max_new_tokens // 2]
    costs = measure_step_costs(target, drafter, context, cfg.gamma, cfg.cost_repeats)
    costs.verify_ratios = measure_verify_ratios(target, context, VERIFY_GAMMAS, cfg.cost_repeats)
    return costs


def run_core_benchmark(
    target_name: str,
    device: str,
    dtypes: Sequence[str] = ("float32", "bfloat16"),
    batch_sizes: Sequence[int] = (1, 8),
    gamma: int = 4,
    new_tokens: int = 64,
    prompts_at_batch_1: int = 3,
    rounds: int = 3,
    writer_batch: int = 256,
    writer_tokens: int = 64,
    drafter: str | None = None,
    only: Sequence[str] = (),
    progress: Callable[[str], None] = print,
    profile: bool = False,
    time_limit_s: float | None = None,
    step_costs: bool = False,
) -> list[Row]:
    """Per dtype, time the data writer at `writer_batch` (0: not), then every method per batch size.
    `drafter`: a saved feature drafter to time instead of an untrained one; `only`: the methods
    whose names contain one of these; `step_costs`: first print each drafter's step costs per core."""
    check_only(only)
    for dtype in dtypes:
        resolve_dtype(dtype)  # a bad name fails before any group is timed
    if time_limit_s is not None and not time_limit_s > 0:  # NaN too
        raise ValueError(f"time_limit_s must be positive, got {time_limit_s}")
    deadline = math.inf if time_limit_s is None else time.perf_counter() + time_limit_s
    rows: list[Row] = []
    for dtype in dtypes:
        if time.perf_counter() > deadline:
            progress(f"{target_name} in {dtype}: not timed, past the time limit")
            continue
        target, prompts = build_target(
            target_name, dtype, device, max([*batch_sizes, prompts_at_batch_1, writer_batch])
        )
        progress(f"{target_name} in {dtype} on {device}")
        drafters = drafters_of(target, drafter)
        if step_costs and time.perf_counter() < deadline:
            costs = {kind: core_step_costs(target, d, prompts[0], new_tokens, gamma) for kind, d in drafters.items()}
            progress(f"step costs at gamma {gamma}, batch 1:\n{costs_markdown(costs)}")
        # the data writer first: it compiles one shape, where the decode groups compile several
        groups = [(writer_batch, data_writers(target, writer_tokens), prompts[:writer_batch])] if writer_batch else []
        for batch_size in batch_sizes:
            group = prompts[:prompts_at_batch_1] if batch_size == 1 else prompts[:batch_size]
            # one cache capacity for all of the group's prompts: one compiled shape per method
            capacity = static_capacity(max(len(p) for p in group) + new_tokens + gamma + 2)
            groups.append((batch_size, methods(target, gamma, new_tokens, batch_size, drafters, capacity), group))
        for batch_size, found, group in groups:
            found = {name: m for name, m in found.items() if not only or any(word in name for word in only)}
            for name, measured in time_group(found, group, batch_size, rounds, progress, deadline).items():
                rows.append(Row(target_name, dtype, batch_size, name, **measured))
                progress(format_row(asdict(rows[-1])))
            if profile:
                profile_group(found, group[:batch_size], progress, deadline)
    return rows
