"""The evaluation's results on the tracker (`logger=wandb`): tables, plots and token pages, in one log call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# results.json row keys, in the table's column order (position_acceptance, a list, stays in the file)
ROW_COLUMNS = tuple(
    "domain method gamma temperature batch_size prompts max_new_tokens alpha tau tokens_per_s speedup "
    "exact_match".split()
)
SHARE_COLUMNS = tuple(
    "temperature batch_size best_single best_single_speedup oracle_speedup routed_speedup routed_share "
    "routed_choices_speedup routed_choices_share".split()
)
# report.md's plots (`specdecode.evaluation.report.write_report`)
PLOTS = ("speedup", "gamma_sweep", "position_acceptance")


def tracker_values(wandb: Any, results: dict, out_dir: Path) -> dict[str, Any]:
    """What the run logs: `results` (written to `out_dir`) as wandb Tables, Images and Html."""
    values: dict[str, Any] = {"results": _table(wandb, ROW_COLUMNS, results["rows"])}
    if results.get("router_share"):
        values["router_share"] = _table(wandb, SHARE_COLUMNS, results["router_share"])
    for plot in PLOTS:
        if (out_dir / f"{plot}.png").is_file():
            values[plot] = wandb.Image(str(out_dir / f"{plot}.png"))
    for page in sorted(out_dir.glob("tokens-*.html")):
        values[page.stem] = wandb.Html(page.read_text(encoding="utf-8"))
    return values


def log_results(accelerator: Any, results: dict, out_dir: Path) -> None:
    """Log `tracker_values` to the wandb run of `accelerator` (main process)."""
    import wandb

    accelerator.get_tracker("wandb", unwrap=True).log(tracker_values(wandb, results, out_dir))


def _table(wandb: Any, columns: tuple[str, ...], rows: list[dict]) -> Any:
    return wandb.Table(columns=list(columns), data=[[row.get(column) for column in columns] for row in rows])
