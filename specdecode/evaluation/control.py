"""Routing against its honest control: `alldata`, one drafter trained on the domain drafters' data
for their minutes together. Where routing is not accepted more often, `alldata` is the default.
"""

from __future__ import annotations

from typing import Any

from specdecode.evaluation.report import fmt

# The control's method name in the evaluation's rows, and its drafter's name in `EvalConfig.drafters`.
CONTROL = "alldata"


def control_comparison(results: dict[str, Any]) -> dict[str, Any] | None:
    """Routed against `CONTROL` per domain in realised alpha (by speedup where routed drafts nothing),
    greedy, at the smallest batch size and the evaluation's gamma; `default_drafter` is `routed`
    where it beats the control in every domain. None where a domain lacks a row of either."""
    rows, config = results["rows"], results["config"]
    if not rows:
        return None
    gamma, batch = config["gamma"], min(r["batch_size"] for r in rows)
    here = {
        (r["domain"], r["method"]): r
        for r in rows
        if r["temperature"] == 0.0 and r["batch_size"] == batch and (gamma is None or r["gamma"] == gamma)
    }
    pairs = {d: (here.get((d, "routed")), here.get((d, CONTROL))) for d in config["domains"]}
    domains = {}
    for domain, (routed, control) in pairs.items():
        if routed is None or control is None or control["alpha"] is None:
            return None
        judged_by = "alpha" if routed["alpha"] is not None else "speedup"
        domains[domain] = {
            "routed_alpha": routed["alpha"],
            f"{CONTROL}_alpha": control["alpha"],
            "routed_speedup": routed["speedup"],
            f"{CONTROL}_speedup": control["speedup"],
            "judged_by": judged_by,
            "routed_beats": (routed[judged_by] or 0.0) > (control[judged_by] or 0.0),
        }
    beats = all(d["routed_beats"] for d in domains.values())
    return {
        "temperature": 0.0,
        "batch_size": batch,
        "gamma": gamma,
        "domains": domains,
        "default_drafter": "routed" if beats else CONTROL,
    }


def control_section(comparison: dict[str, Any], drafter_path: str) -> list[str]:
    """report.md's lines on routing against the control, and which is the default, in plain words."""
    lines = [
        f"## Routing against the all-data drafter (`{CONTROL}`)",
        "",
        f"`{CONTROL}` is one drafter trained on every domain's data (the sequences the domain drafters saw) for "
        "the minutes the generic and the domain drafters took together. Greedy, batch "
        f"{comparison['batch_size']}, gamma {comparison['gamma'] if comparison['gamma'] is not None else 'stored'}; "
        "a domain the router sends to plain decoding (no alpha) is judged by speedup:",
        "",
        f"| domain | routed alpha | {CONTROL} alpha | routed speedup | {CONTROL} speedup | routed beats it |",
        "|---|---|---|---|---|---|",
    ]
    for domain, d in comparison["domains"].items():
        lines.append(
            f"| {domain} | {fmt(d['routed_alpha'], 3)} | {fmt(d[f'{CONTROL}_alpha'], 3)} | "
            f"{fmt(d['routed_speedup'], 2)}× | {fmt(d[f'{CONTROL}_speedup'], 2)}× | "
            f"{'yes' if d['routed_beats'] else 'no'} |"
        )
    lines.append("")
    losing = [
        f"{domain} ({d['judged_by']} {fmt(d['routed_' + d['judged_by']], 3)} vs "
        f"{fmt(d[f'{CONTROL}_' + d['judged_by']], 3)})"
        for domain, d in comparison["domains"].items()
        if not d["routed_beats"]
    ]
    if losing:
        lines.append(
            f"Routing does not beat the all-data drafter on {', '.join(losing)}: the specialists do not pay for "
            f"splitting the data and minutes, so the default drafter is `{CONTROL}` (`{drafter_path}`), not routing."
        )
    else:
        lines.append("Routing beats the all-data drafter on every domain: routing is the default.")
    return [*lines, ""]
