"""The decode benchmark's record and report: `benchmark_results` (what every run records: when, on
what machine, its rows) and `report_markdown`, the one writer of both apps' reports."""

from __future__ import annotations

import os
import platform
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from typing import Any

import torch

from specdecode.decoding.timing import StepCosts
from specdecode.evaluation.benchmark_methods import Row
from specdecode.evaluation.report import fmt

# The columns of a rows' table: `Row` fields, headed by their names with spaces.
COLUMNS = tuple(
    "target dtype batch_size method tokens_per_s first_call_s speedup alpha tau predicted_speedup loop_efficiency "
    "exact_match agreement".split()
)
# The digits of a float column where not 2.
DIGITS = {"tokens_per_s": 1, "first_call_s": 1, "alpha": 3}


def benchmark_results(rows: Sequence[Row], device: str) -> dict[str, Any]:
    """What every run of the benchmark records: when, on what machine, and its rows."""
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "device": device,
        },
        "rows": [asdict(row) for row in rows],
    }


def report_markdown(results: Mapping[str, Any]) -> str:
    """The results as markdown: what ran where, the rows' table, and (`run_benchmark`) the step costs."""
    machine = results["machine"]
    lines = [
        f"# Decode benchmark — {results['date']}",
        "",
        f"Device {machine['device']} ({machine['cpus']} CPUs), torch {machine['torch']}."
        + (f" {_setting(results)}" if "config" in results else ""),
        "",
        # the setting line names the target and dtype of a `run_benchmark` run
        *rows_table(results["rows"], leave_out=("target", "dtype") if "config" in results else ()),
    ]
    if "step_costs" in results:
        lines += ["", *_cost_lines(results)]
    if results.get("step_table"):
        lines += ["", *_step_table_lines(results["step_table"])]
    if results.get("ours_vs_transformers_assisted"):
        lines.append(
            "Ours vs transformers assisted generation (same drafter, gamma): "
            f"{results['ours_vs_transformers_assisted']:.2f}×."
        )
    if any(row.get("predicted_speedup") is not None for row in results["rows"]):
        lines += [
            "",
            "Predicted speedup: Leviathan et al. Thm 3.8 with the measured alpha, c and verify cost; "
            "loop efficiency = measured / predicted.",
        ]
    return "\n".join(lines) + "\n"


def rows_table(rows: Sequence[Mapping[str, Any]], leave_out: Collection[str] = ()) -> list[str]:
    """`rows` (`Row`s as dicts) as a markdown table, in the columns but `leave_out` where some row has a value."""
    columns = [key for key in COLUMNS if key not in leave_out and any(row.get(key) is not None for row in rows)]
    return [
        "| " + " | ".join(key.replace("_", " ") for key in columns) + " |",
        "|---" * len(columns) + "|",
        *(format_row(row, columns) for row in rows),
    ]


def format_row(row: Mapping[str, Any], columns: Sequence[str] = COLUMNS) -> str:
    """One row of `rows_table` (every column by default: a row printed as soon as it is timed)."""
    return "| " + " | ".join(fmt(row.get(key), DIGITS.get(key, 2)) for key in columns) + " |"


def _setting(results: Mapping[str, Any]) -> str:
    """The target, drafter, decoding and prompts of a `run_benchmark` run."""
    cfg, drafter = results["config"], results["config"]["drafter"]
    return (
        f"Target `{cfg['target']['name']}` ({cfg['dtype']}); drafter: {drafter['kind']} "
        f"({drafter['num_layers']} layers, draft vocab {drafter['draft_vocab'] or 'full'}); "
        f"gamma {cfg['gamma']}, {cfg['max_new_tokens']} new tokens, temperature {cfg['temperature']}; "
        f"prompts: {', '.join(p['domain'] for p in results['prompts'])}."
    )


def _cost_lines(results: Mapping[str, Any]) -> list[str]:
    """The step costs at the configured gamma and the verify cost at every gamma, in words."""
    costs, machine = results["step_costs"], results["machine"]
    return [
        f"Step costs (batch 1, {costs['context_tokens']}-token context): "
        f"target step {costs['target_step_s'] * 1e3:.1f} ms, "
        f"verify of {costs['gamma'] + 1} tokens {costs['target_verify_s'] * 1e3:.1f} ms "
        f"(verify cost {costs['verify_ratio']:.2f}× a step), drafter step {costs['drafter_step_s'] * 1e3:.1f} ms "
        f"(c = {costs['cost_ratio']:.3f}).",
        "Verify of gamma + 1 tokens over a step: "
        + ", ".join(f"gamma {g}: {r:.2f}×" for g, r in costs.get("verify_ratios", {}).items())
        + f" ({_kernel_note(machine)}; skinny_matmul={results['config'].get('skinny_matmul')}).",
    ]


def _step_table_lines(table: Mapping[str, Any]) -> list[str]:
    """The step table gamma "auto" chose from, in target steps at batch 1."""
    widths = range(len(table["seconds"][0]))
    lines = [
        "Step cost in target steps, per batch size (rows) and gamma (columns), timed whole:",
        "",
        "| batch | " + " | ".join(f"γ={g}" for g in widths) + " |",
        "|---" * (len(widths) + 1) + "|",
    ]
    for batch, seconds in zip(table["batch_sizes"], table["seconds"]):
        lines.append(f"| {batch} | " + " | ".join(f"{s / seconds[0]:.2f}" for s in seconds) + " |")
    return [*lines, f"(a target step at batch 1: {table['seconds'][0][0] * 1e3:.1f} ms)"]


def _kernel_note(machine: Mapping[str, Any]) -> str:
    """The CPU kernel a results.json records (`skinny_rows`)."""
    rows = machine["skinny_rows"]
    if not rows:
        return "skinny linears off"
    return (
        f"skinny linears for {rows[0]}..{rows[1]} rows" if rows[0] != rows[1] else f"skinny linears for {rows[0]} row"
    )


def costs_markdown(costs: Mapping[str, Mapping[str, StepCosts]]) -> str:
    """A table of `core_step_costs` per drafter: drafter name → core → costs."""
    lines = [
        "| drafter | core | target step ms | verify ms | drafter step ms | c | verify ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for drafter, by_core in costs.items():
        for core, c in by_core.items():
            lines.append(
                f"| {drafter} | {core} | {c.target_step_s * 1e3:.2f} | {c.target_verify_s * 1e3:.2f} | "
                f"{c.drafter_step_s * 1e3:.2f} | {c.cost_ratio:.3f} | {c.verify_ratio:.2f} |"
            )
    return "\n".join(lines)
