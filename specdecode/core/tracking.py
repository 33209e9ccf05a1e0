"""With `logger=wandb`, an app's records also go to a wandb run (accelerate's tracker) under its output folder."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdecode.core.config import require_choice

LOGGERS = ("jsonl", "wandb")
WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class Tracking:
    """An app's tracker settings; apps subclass this and call `check_tracking()`."""

    # jsonl: the app's own files only (metrics.jsonl, results.json); wandb: also a wandb run under output_dir/wandb/
    logger: str = "jsonl"
    wandb_project: str = "specdecode"
    wandb_mode: str = "offline"

    def check_tracking(self) -> None:
        require_choice("logger", self.logger, LOGGERS)
        require_choice("wandb_mode", self.wandb_mode, WANDB_MODES)

    @property
    def log_with(self) -> str | None:
        """The tracker an `Accelerator` is made with (`log_with=`): "wandb", or None."""
        return "wandb" if self.logger == "wandb" else None


def check_tracker_installed(cfg: Tracking) -> None:
    """An ImportError saying how to install wandb, before any work, where `logger=wandb` lacks it."""
    if cfg.logger == "wandb" and importlib.util.find_spec("wandb") is None:
        raise ImportError("logger=wandb needs the wandb package, which is not installed: pip install wandb")


def start_tracking(accelerator: Any, cfg: Tracking, config: dict[str, Any], output: Path) -> None:
    """Start the accelerator's trackers with the app's resolved `config`: a wandb run in
    `cfg.wandb_mode` under `output`/wandb/ where `logger=wandb`; a no-op without trackers."""
    accelerator.init_trackers(
        project_name=cfg.wandb_project,
        config=config,
        init_kwargs={"wandb": {"mode": cfg.wandb_mode, "dir": str(output)}},
    )
