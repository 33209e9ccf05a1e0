"""report.md and PNG plots from evaluation results (one run, or a merged gamma multirun)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from specdecode.core.atomic import write_atomic
from specdecode.core.config import config_differences
from specdecode.evaluation.token_pages import token_page_links
from specdecode.routing.report import percent


def _pyplot() -> Any:
    """matplotlib on its file-only backend, imported only when a plot is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def fmt(value: object, digits: int = 2) -> str:
    """A table cell: floats to `digits` places, None as a dash."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


# Config keys the runs of one merged sweep may differ in: the swept gamma, and each run's folder.
SWEPT_KEYS = frozenset({"gamma", "output_dir"})


def check_same_sweep(configs: dict[str, dict]) -> None:
    """A ValueError listing each differing key where the runs' configs (by results file) differ beyond
    `SWEPT_KEYS`: runs of two sweeps written into one folder are not one table."""
    (first, base), *others = configs.items()
    differences = [
        line
        for source, config in others
        for line in config_differences(base or {}, config or {}, SWEPT_KEYS, f"in {first}", f"in {source}")
    ]
    if differences:
        raise ValueError(
            "these results come from runs with different configs (one sweep may differ only in "
            f"{', '.join(sorted(SWEPT_KEYS))}); differing keys:\n  "
            + "\n  ".join(differences)
            + "\nMerge one sweep's runs: move the other runs' folders out, or sweep into another output_dir"
        )


def merge_results(paths: Iterable[Path]) -> dict:
    """Rows and router shares (tagged with their gamma) of several results.json files of a gamma
    multirun as one result; a ValueError for no file or another sweep's (`check_same_sweep`)."""
    merged: dict = {"rows": [], "sources": [], "router_share": []}
    runs = {str(path): json.loads(Path(path).read_text()) for path in sorted(paths)}
    if not runs:
        raise ValueError("no results.json files to merge")
    check_same_sweep({path: data.get("config") for path, data in runs.items()})
    for path, data in runs.items():
        merged["rows"] += data["rows"]
        gamma = (data.get("config") or {}).get("gamma")
        merged["router_share"] += [share | {"gamma": gamma} for share in data.get("router_share") or []]
        merged["sources"].append(str(path))
        merged.setdefault("config", data.get("config"))
        merged.setdefault("date", data.get("date"))
    return merged


# A markdown link or image: `[text](target)` / `![text](target)`; the target is group 1.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def rebase_links(text: str, source_dir: Path, dest_dir: Path) -> str:
    """`text`, a report written in `source_dir`, with its relative link targets rewritten to resolve from `dest_dir`."""

    def rebase(match: re.Match[str]) -> str:
        target = match.group(1)
        if "://" in target or target.startswith(("#", "/", "mailto:")):
            return match.group(0)
        moved = Path(os.path.relpath(source_dir / target, dest_dir)).as_posix()
        start, end = match.span(1)
        whole = match.group(0)
        return whole[: start - match.start()] + moved + whole[end - match.start() :]

    return _LINK.sub(rebase, text)


def markdown_table(rows: list[dict]) -> str:
    header = (
        "| domain | method | gamma | T | batch | prompts | new tokens "
        "| alpha | tau | tokens/s | speedup | exact match |"
    )
    lines = [header, "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| {r['domain']} | {r['method']} | {r['gamma']} | {r['temperature']} | {r['batch_size']} | "
            f"{r.get('prompts', '–')} | {r.get('max_new_tokens', '–')} | "
            f"{fmt(r['alpha'], 3)} | {fmt(r['tau'])} | {fmt(r['tokens_per_s'])} | {fmt(r['speedup'])}× | "
            f"{fmt(r['exact_match'])} |"
        )
    return "\n".join(lines)


def share_table(shares: list[dict]) -> str:
    """The router's share of the oracle's gain as a markdown table (a gamma column for merged runs)."""
    tagged = any("gamma" in s for s in shares)
    lines = [
        ("| gamma " if tagged else "")
        + "| T | batch | best single drafter | oracle | routed (share) | routed_choices (share) |",
        "|---" * (7 if tagged else 6) + "|",
    ]
    for s in shares:
        cells = [
            f"{fmt(s.get(f'{c}_speedup'), 3)}× ({percent(s.get(f'{c}_share'))})" if f"{c}_speedup" in s else "–"
            for c in ("routed", "routed_choices")
        ]
        lines.append(
            (f"| {fmt(s.get('gamma'))} " if tagged else "")
            + f"| {s['temperature']} | {s['batch_size']} | {s['best_single']} {fmt(s['best_single_speedup'], 3)}× | "
            f"{fmt(s['oracle_speedup'], 3)}× | {cells[0]} | {cells[1]} |"
        )
    return "\n".join(lines)


def share_section(shares: list[dict]) -> list[str]:
    """report.md's lines on the router's share of the oracle's gain; none without a share."""
    if not shares:
        return []
    return [
        "## The router's share of the oracle's gain",
        "",
        share_table(shares),
        "",
        "Speedups averaged over the domains; share = (routed − best single) / (oracle − best single). "
        "`routed_choices` scores the router's choices on the drafters' own batch-1 runs, the runs the oracle "
        "picks from, plus the router's seconds, so that it and the oracle differ only on the prompts where "
        "their choices do; the routed row is the router's own run, timed apart.",
        "",
    ]


def plot_speedup(rows: list[dict], path: Path) -> None:
    """Bars: speedup over autoregressive per domain and method (greedy, batch 1, one gamma)."""
    chosen = [r for r in rows if r["temperature"] == 0.0 and r["batch_size"] == min(x["batch_size"] for x in rows)]
    domains = sorted({r["domain"] for r in chosen})
    methods = [m for m in dict.fromkeys(r["method"] for r in chosen) if m != "autoregressive"]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(domains) * max(len(methods), 1) / 3), 4))
    width = 0.8 / max(len(methods), 1)
    for k, method in enumerate(methods):
        values = [
            next((r["speedup"] or 0.0 for r in chosen if r["domain"] == d and r["method"] == method), 0.0)
            for d in domains
        ]
        ax.bar([i + k * width for i in range(len(domains))], values, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(domains))], domains)
    ax.set_ylabel("speedup over autoregressive")
    ax.legend(fontsize="small")
    _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def sweep_series(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows of each (domain, method, temperature, batch size) that ran at two or more gammas, by gamma."""
    series: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["method"] != "autoregressive" and r["alpha"] is not None and isinstance(r["gamma"], int):
            series.setdefault((r["domain"], r["method"], r["temperature"], r["batch_size"]), []).append(r)
    return {
        key: sorted(group, key=lambda r: r["gamma"])
        for key, group in series.items()
        if len({r["gamma"] for r in group}) >= 2
    }


def plot_gamma_sweep(rows: list[dict], path: Path) -> None:
    """Acceptance and tokens/s against gamma, one line per swept setting; the target alone's dashed."""
    series = sweep_series(rows)
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for (domain, method, temperature, batch), group in sorted(series.items(), key=lambda kv: str(kv[0])):
        label = f"{domain} / {method} (T={temperature}, B={batch})"
        gammas = [r["gamma"] for r in group]
        left.plot(gammas, [r["alpha"] for r in group], marker="o", label=label)
        right.plot(gammas, [r["tokens_per_s"] for r in group], marker="o", label=label)
    for r in rows:
        if r["method"] == "autoregressive" and any(
            k[0] == r["domain"] and k[2:] == (r["temperature"], r["batch_size"]) for k in series
        ):
            right.axhline(r["tokens_per_s"], linestyle="--", linewidth=0.8, color="gray")
    left.set(xlabel="gamma (drafts per target pass)", ylabel="alpha (per-token acceptance)")
    right.set(xlabel="gamma (drafts per target pass)", ylabel="tokens/s (dashed: target alone)")
    if series:
        left.legend(fontsize="xx-small")
    else:
        left.set_title("no gamma sweep in these results", fontsize="small")
    _save(plt, fig, path)


def plot_position_acceptance(rows: list[dict], path: Path) -> None:
    """P(draft i accepted | drafts before it accepted), per domain and method (greedy, batch 1)."""
    chosen = [
        r for r in rows if r["method"] != "autoregressive" and r["temperature"] == 0.0 and r.get("position_acceptance")
    ]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in chosen:
        values = [v if v is not None else float("nan") for v in r["position_acceptance"]]
        ax.plot(
            range(1, len(values) + 1),
            values,
            marker=".",
            label=f"{r['domain']} / {r['method']} (γ={r['gamma']}, B={r['batch_size']})",
        )
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance given the previous drafts were accepted")
    ax.legend(fontsize="xx-small")
    _save(plt, fig, path)


def compile_lines(compile_seconds: dict[str, float]) -> list[str]:
    """Each method's seconds compiling, kept out of its rows' times."""
    if not compile_seconds:
        return []
    spent = ", ".join(f"{method} {seconds:.1f} s" for method, seconds in compile_seconds.items())
    return [
        f"Compiled decode core: the main process's seconds spent compiling, kept out of the rows' times "
        f"(each shape's first decode ran again, timed): {spent}.",
        "",
    ]


def write_report(results: dict, out_dir: Path) -> Path:
    """Write report.md and its PNG plots into `out_dir`; return the report's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = results["rows"]
    plot_speedup(rows, out_dir / "speedup.png")
    plot_gamma_sweep(rows, out_dir / "gamma_sweep.png")
    plot_position_acceptance(rows, out_dir / "position_acceptance.png")
    text = "\n".join(
        [
            f"# Evaluation report — {results.get('date', '')}",
            "",
            markdown_table(rows),
            "",
            "Speedup is tokens/s over `autoregressive` at the same domain, temperature and batch size; "
            "exact match is the share of prompts whose output equals target-only greedy (greedy rows only).",
            "",
            *compile_lines(results.get("compile_seconds") or {}),
            *share_section(results.get("router_share") or []),
            *token_page_links(out_dir),
            "![speedup per domain and method](speedup.png)",
            "![acceptance and tokens/s vs gamma](gamma_sweep.png)",
            "![per-position acceptance](position_acceptance.png)",
            "",
        ]
    )
    path = out_dir / "report.md"
    write_atomic(path, text)
    return path
