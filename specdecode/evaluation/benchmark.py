"""The decode benchmark: target alone vs our speculative loop vs transformers assisted generation.

One run measures, on a fixed prompt set: tokens/s of each method at batch 1, our loop against
autoregressive decoding at batch B, the step costs (c and the verify cost), the speedup Leviathan's
model predicts from them and the measured alpha, and loop efficiency = measured / predicted.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode.core.atomic import write_atomic
from specdecode.core.devices import resolve_device
from specdecode.core.locking import check_writable
from specdecode.data.corpus import vocab_corpus
from specdecode.data.domains import DOMAINS, format_prompt, load_domain
from specdecode.decoding.decode import adaptive_gamma, autoregressive_generate, speculative_generate
from specdecode.decoding.sampling import SamplingParams
from specdecode.decoding.speedup import predicted_speedup
from specdecode.decoding.stats import GenerationResult
from specdecode.decoding.timing import StepCosts, measure_step_costs, measure_verify_ratios
from specdecode.evaluation.config import BenchmarkConfig
from specdecode.evaluation.report import fmt
from specdecode.models.compat import default_eos
from specdecode.models.cpu_matmul import skinny_rows_of
from specdecode.models.feature_drafter import FeatureDrafter
from specdecode.models.loading import build_drafter, load_target

# The gammas whose verify cost the benchmark reports (a pass of gamma + 1 tokens).
VERIFY_GAMMAS = tuple(range(1, 9))


def benchmark_prompts(
    tokenizer: PreTrainedTokenizerBase, num_prompts: int, max_tokens: int
) -> list[tuple[str, list[int]]]:
    """The first held-out prompts of each domain, interleaved, chat-formatted: [(domain, ids)].

    Prompts longer than `max_tokens` are skipped, never truncated.
    """
    pools = {domain: iter(load_domain(domain, split="heldout")) for domain in DOMAINS}
    chosen: list[tuple[str, list[int]]] = []
    while len(chosen) < num_prompts and pools:
        for domain in list(pools):
            ids = next(
                (ids for ex in pools[domain] if len(ids := format_prompt(tokenizer, ex.prompt)) <= max_tokens), None
            )
            if ids is None:
                del pools[domain]
            elif len(chosen) < num_prompts:
                chosen.append((domain, ids))
    if len(chosen) < num_prompts:
        raise ValueError(f"only {len(chosen)} held-out prompts fit max_prompt_tokens={max_tokens}; need {num_prompts}")
    return chosen


def assisted_generate(
    target: PreTrainedModel,
    drafter: PreTrainedModel,
    prompt: list[int],
    gamma: int,
    max_new_tokens: int,
    eos: list[int],
    min_new_tokens: int | None = None,
) -> tuple[list[int], float]:
    """transformers assisted generation, greedy, with a fixed gamma (constant schedule, no early stop
    on confidence): the new tokens and the seconds they took."""
    drafter.generation_config = copy.deepcopy(drafter.generation_config)
    drafter.generation_config.num_assistant_tokens = gamma
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    drafter.generation_config.assistant_confidence_threshold = 0.0
    input_ids = torch.tensor([prompt], device=target.device)
    start = time.perf_counter()
    out = target.generate(  # type: ignore[operator]  # transformers types `generate` through nn.Module's __getattr__
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        assistant_model=drafter,
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        do_sample=False,
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else 0,
    )
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    return out[0, len(prompt) :].tolist(), time.perf_counter() - start


def _pooled(results: Sequence[GenerationResult]) -> dict[str, Any]:
    """Throughput and acceptance pooled over runs (tokens / seconds, accepts / judged)."""
    tokens = sum(r.stats.generated_tokens for r in results)
    seconds = sum(r.stats.wall_time_s for r in results)
    accepted = sum(r.stats.accepted for r in results)
    rejections = sum(r.stats.rejections for r in results)
    row_calls = sum(r.stats.generated_tokens / r.stats.tau for r in results if r.stats.tau)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "alpha": accepted / (accepted + rejections) if accepted + rejections else None,
        "tau": tokens / row_calls if row_calls else None,
    }


@dataclass
class _Runs:
    """Every timed decode of one benchmark: per prompt at batch 1 (the target alone, ours, and
    transformers assisted generation as `(tokens, seconds)`), and one batch of B (target alone, ours),
    ours at the configured gamma and at gamma="auto"."""

    ar1: list[GenerationResult]
    sd1: list[GenerationResult]
    hf1: list[tuple[list[int], float]]
    arb: GenerationResult
    sdb: GenerationResult
    # ours with gamma="auto" (each step's gamma chosen while decoding), batch 1 and B
    auto1: list[GenerationResult]
    autob: GenerationResult
    # the step costs it chose from (`costs.StepTable.to_dict`)
    table: dict[str, Any]


def run_benchmark(cfg: BenchmarkConfig) -> dict:
    """Run the benchmark; write `results.json` and `report.md` under `cfg.output_dir`; return the results."""
    check_writable(Path(cfg.output_dir))
    torch.manual_seed(cfg.seed)
    steps = tqdm(total=8, desc="benchmark", unit="stage")

    def stage(name: str) -> None:
        steps.set_postfix_str(name)
        steps.update(1)

    target, tokenizer = load_target(
        cfg.target, dtype=cfg.dtype, device=resolve_device(cfg.device), skinny_matmul=cfg.skinny_matmul
    )
    stage("target loaded")
    drafter = build_drafter(cfg.drafter, target, tokenizer, lambda: vocab_corpus(tokenizer, cfg.vocab_corpus_docs))
    stage("drafter built")
    prompts = benchmark_prompts(tokenizer, cfg.num_prompts, cfg.max_prompt_tokens)
    costs, runs = _measure(cfg, target, drafter, [p for _, p in prompts], stage)
    steps.close()

    rows = _rows(cfg, runs, costs)
    results = {
        "config": asdict(cfg),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "device": str(target.device),
            # the CPU kernel in use (skinny_matmul; null: the faster, measured once per machine):
            # the row counts computed as weight @ x.T, null where F.linear does all
            "skinny_rows": skinny_rows_of(target),
        },
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "prompts": [{"domain": d, "tokens": len(p)} for d, p in prompts],
        "step_costs": costs.to_dict(),
        # seconds of a whole step per batch size and gamma (0: the target alone), as gamma auto chose from
        "step_table": runs.table,
        "rows": rows,
        # rows[1]: ours at batch 1; rows[3]: transformers assisted generation, when it ran.
        "ours_vs_transformers_assisted": (rows[1]["tokens_per_s"] / rows[3]["tokens_per_s"]) if runs.hf1 else None,
    }
    out = Path(cfg.output_dir)
    write_atomic(out / "results.json", json.dumps(results, indent=2))
    write_atomic(out / "report.md", report_markdown(results))
    return results


def _measure(
    cfg: BenchmarkConfig,
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter,
    ids: list[list[int]],
    stage: Callable[[str], None],
) -> tuple[StepCosts, _Runs]:
    """Warm up, measure the step costs, then time each method at batch 1 and at batch B."""
    eos = default_eos(target)
    decode: dict[str, Any] = dict(
        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, eos_token_ids=eos, seed=cfg.seed
    )
    lookup = cfg.prompt_lookup

    # Warm-up: first calls pay one-off allocation and dispatch costs that would skew short runs.
    speculative_generate(
        target, drafter, ids[:1], gamma=cfg.gamma, prompt_lookup=lookup, **decode | {"max_new_tokens": 8}
    )
    autoregressive_generate(target, ids[:1], **decode | {"max_new_tokens": 8})
    context = ids[0] + ids[1][: cfg.max_new_tokens // 2]
    costs = measure_step_costs(target, drafter, context, cfg.gamma, cfg.cost_repeats)
    # What a verify of 2..9 tokens costs here decides which gamma can pay (CPU kernels make it
    # uneven in the token count).
    costs.verify_ratios = measure_verify_ratios(target, context, VERIFY_GAMMAS, cfg.cost_repeats)
    stage("step costs measured")

    batch1 = ids[: cfg.batch1_prompts]
    ar1 = [
        autoregressive_generate(target, [p], **decode) for p in tqdm(batch1, desc="batch 1: target alone", leave=False)
    ]
    stage("batch 1 autoregressive")
    sd1 = [
        speculative_generate(target, drafter, [p], gamma=cfg.gamma, prompt_lookup=lookup, **decode)
        for p in tqdm(batch1, desc="batch 1: ours", leave=False)
    ]
    stage("batch 1 speculative")
    hf1: list[tuple[list[int], float]] = []
    # transformers' assisted generation runs causal-LM drafters only, not feature drafters.
    if cfg.hf_assisted and cfg.temperature == 0.0 and not isinstance(drafter, FeatureDrafter):
        hf1 = [
            assisted_generate(target, drafter, p, cfg.gamma, cfg.max_new_tokens, eos)
            for p in tqdm(batch1, desc="batch 1: transformers assisted", leave=False)
        ]
    stage("batch 1 transformers assisted")
    adaptive = adaptive_gamma(target, drafter, SamplingParams(cfg.temperature))  # timed once per machine
    auto1 = [
        speculative_generate(target, drafter, [p], gamma=adaptive, prompt_lookup=lookup, **decode)
        for p in tqdm(batch1, desc="batch 1: ours, gamma auto", leave=False)
    ]
    stage("batch 1 speculative, gamma auto")
    batch = ids[: cfg.batch_size]
    arb = autoregressive_generate(target, batch, **decode)
    sdb = speculative_generate(target, drafter, batch, gamma=cfg.gamma, prompt_lookup=lookup, **decode)
    autob = speculative_generate(target, drafter, batch, gamma=adaptive, prompt_lookup=lookup, **decode)
    stage(f"batch {cfg.batch_size}")
    return costs, _Runs(ar1, sd1, hf1, arb, sdb, auto1, autob, adaptive.costs.to_dict())


def _rows(cfg: BenchmarkConfig, runs: _Runs, costs: StepCosts) -> list[dict]:
    """results.json rows: each method at batch 1 and at batch B, against the target alone."""
    rows = []
    ar1_pooled, sd1_pooled = _pooled(runs.ar1), _pooled(runs.sd1)
    predicted = predicted_speedup(sd1_pooled["alpha"] or 0.0, cfg.gamma, costs.cost_ratio, costs.verify_ratio)
    measured = sd1_pooled["tokens_per_s"] / ar1_pooled["tokens_per_s"]
    reference = [r.sequences[0] for r in runs.ar1]
    rows.append({"method": "target alone", "batch_size": 1, **ar1_pooled, "speedup": 1.0, "exact_match": 1.0})
    rows.append(
        {
            "method": "specdecode",
            "batch_size": 1,
            **sd1_pooled,
            "speedup": measured,
            "predicted_speedup": predicted,
            "loop_efficiency": measured / predicted,
            "exact_match": _match([r.sequences[0] for r in runs.sd1], reference),
        }
    )
    rows.append(_auto_row(runs.auto1, ar1_pooled, reference))
    if runs.hf1:
        hf_tokens = sum(len(s) for s, _ in runs.hf1)
        hf_seconds = sum(t for _, t in runs.hf1)
        rows.append(
            {
                "method": "transformers assisted",
                "batch_size": 1,
                "tokens": hf_tokens,
                "seconds": hf_seconds,
                "tokens_per_s": hf_tokens / hf_seconds,
                "speedup": hf_tokens / hf_seconds / ar1_pooled["tokens_per_s"],
                "exact_match": _match([s for s, _ in runs.hf1], reference),
            }
        )
    arb_pooled, sdb_pooled = _pooled([runs.arb]), _pooled([runs.sdb])
    rows.append(
        {
            "method": "target alone",
            "batch_size": len(runs.arb.sequences),
            **arb_pooled,
            "speedup": 1.0,
            "exact_match": 1.0,
        }
    )
    rows.append(
        {
            "method": "specdecode",
            "batch_size": len(runs.sdb.sequences),
            **sdb_pooled,
            "speedup": sdb_pooled["tokens_per_s"] / arb_pooled["tokens_per_s"],
            "exact_match": _match(runs.sdb.sequences, runs.arb.sequences),
        }
    )
    rows.append(_auto_row([runs.autob], arb_pooled, runs.arb.sequences))
    return rows


def _auto_row(results: list[GenerationResult], alone: dict[str, Any], reference: Sequence[list[int]]) -> dict:
    """The row of ours with gamma="auto" against the target alone's pooled figures `alone`."""
    pooled = _pooled(results)
    steps: dict[int, int] = {}
    for r in results:
        for gamma, n in r.stats.gamma_steps.items():
            steps[gamma] = steps.get(gamma, 0) + n
    return {
        "method": "specdecode, gamma auto",
        "batch_size": len(results[0].sequences) if len(results) == 1 else 1,
        **pooled,
        "speedup": pooled["tokens_per_s"] / alone["tokens_per_s"],
        "exact_match": _match([s for r in results for s in r.sequences], reference),
        "gamma_steps": {str(g): n for g, n in sorted(steps.items())},  # JSON keys
    }


def _match(sequences: Sequence[list[int]], reference: Sequence[list[int]]) -> float:
    """Fraction of rows identical to the reference (target-only greedy)."""
    return sum(a == b for a, b in zip(sequences, reference)) / len(reference)


def report_markdown(results: dict) -> str:
    """The results as markdown tables (report.md)."""
    cfg, costs = results["config"], results["step_costs"]
    lines = [
        f"# Decode benchmark — {results['date']}",
        "",
        f"Target `{cfg['target']['name']}` ({cfg['dtype']}, {results['machine']['device']}, "
        f"{results['machine']['cpus']} CPUs); drafter: {cfg['drafter']['kind']} "
        f"({cfg['drafter']['num_layers']} layers, draft vocab {cfg['drafter']['draft_vocab'] or 'full'}); "
        f"gamma {cfg['gamma']}, {cfg['max_new_tokens']} new tokens, temperature {cfg['temperature']}; "
        f"prompts: {', '.join(p['domain'] for p in results['prompts'])}.",
        "",
        "| method | batch | tokens/s | speedup | alpha | tau | predicted | loop efficiency | exact match |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['method']} | {row['batch_size']} | {fmt(row['tokens_per_s'])} | {fmt(row['speedup'])}× | "
            f"{fmt(row.get('alpha'), 3)} | {fmt(row.get('tau'))} | {fmt(row.get('predicted_speedup'))} | "
            f"{fmt(row.get('loop_efficiency'))} | {fmt(row['exact_match'])} |"
        )
    lines += [
        "",
        f"Step costs (batch 1, {costs['context_tokens']}-token context): "
        f"target step {costs['target_step_s'] * 1e3:.1f} ms, "
        f"verify of {costs['gamma'] + 1} tokens {costs['target_verify_s'] * 1e3:.1f} ms "
        f"(verify cost {costs['verify_ratio']:.2f}× a step), drafter step {costs['drafter_step_s'] * 1e3:.1f} ms "
        f"(c = {costs['cost_ratio']:.3f}).",
        "Verify of gamma + 1 tokens over a step: "
        + ", ".join(f"gamma {g}: {r:.2f}×" for g, r in costs.get("verify_ratios", {}).items())
        + f" ({_kernel_note(results['machine'])}; skinny_matmul={cfg.get('skinny_matmul')}).",
    ]
    table = results.get("step_table")
    if table:
        lines += ["", "Step cost in target steps, per batch size (rows) and gamma (columns), timed whole:", ""]
        widths = range(len(table["seconds"][0]))
        lines += ["| batch | " + " | ".join(f"γ={g}" for g in widths) + " |", "|---" * (len(widths) + 1) + "|"]
        for batch, seconds in zip(table["batch_sizes"], table["seconds"]):
            lines.append(f"| {batch} | " + " | ".join(f"{s / seconds[0]:.2f}" for s in seconds) + " |")
        lines.append(f"(a target step at batch 1: {table['seconds'][0][0] * 1e3:.1f} ms)")
    if results.get("ours_vs_transformers_assisted"):
        lines.append(
            "Ours vs transformers assisted generation (same drafter, gamma): "
            f"{results['ours_vs_transformers_assisted']:.2f}×."
        )
    lines.append("")
    lines.append(
        "Predicted speedup: Leviathan et al. Thm 3.8 with the measured alpha, c and verify cost; "
        "loop efficiency = measured / predicted."
    )
    return "\n".join(lines) + "\n"


def _kernel_note(machine: dict) -> str:
    """The CPU kernel a results.json records (`skinny_rows`)."""
    rows = machine["skinny_rows"]
    if rows:
        return (
            f"skinny linears for {rows[0]}..{rows[1]} rows"
            if rows[0] != rows[1]
            else f"skinny linears for {rows[0]} row"
        )
    return "skinny linears off"
