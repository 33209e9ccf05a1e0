"""Run one of the apps (train/distill.py, eval/acceptance.py, ...) under `accelerate launch` on a
config the demo composed: the demo's training and evaluation stages go through the launcher a user
would type, so `accelerate=multi_gpu` trains with DDP over the machine's GPUs and splits the
evaluation's prompts across them, with no code path of the demo's own.

The resolved config is written as a one-file config directory whose defaults list names the app's
schema (`specdecode.pipeline.schemas`), so the app composes exactly the config the stage hashed.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from specdecode.pipeline.config import CONF_DIR

ROOT = CONF_DIR.parent
# The app script each launched stage runs, and the ConfigStore schema its config composes onto.
APPS: dict[str, tuple[str, str]] = {
    "distill": ("train/distill.py", "train_job_schema"),
    "finetune": ("train/finetune.py", "train_job_schema"),
    "eval": ("eval/acceptance.py", "eval_schema"),
}


def launch_command(app: str, accelerate_config: Path, config_dir: Path, device: str = "cpu") -> list[str]:
    """`python -m accelerate.commands.launch --config_file <file> <app script> --config-path <dir>
    --config-name stage` (the interpreter running the demo, so its environment).

    A single process on `cuda:N` gets `--gpu_ids all`: a config's `gpu_ids: "0"` would hide every
    other GPU (CUDA_VISIBLE_DEVICES), and the app honours N itself.
    """
    script, _ = APPS[app]
    single = OmegaConf.load(accelerate_config).get("num_processes", 1) == 1
    gpu_ids = ["--gpu_ids", "all"] if single and device.startswith("cuda:") else []
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_config), *gpu_ids,
        str(ROOT / script), "--config-path", str(config_dir), "--config-name", "stage",
    ]


def _escaped(value: Any) -> Any:
    """`value` with `${` in its strings escaped, so OmegaConf reads them back literally."""
    if isinstance(value, dict):
        return {k: _escaped(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escaped(v) for v in value]
    return value.replace("${", "\\${") if isinstance(value, str) else value


def write_stage_config(app: str, config: dict[str, Any], config_dir: Path, hydra_dir: Path) -> Path:
    """`<config_dir>/stage.yaml`: the app's schema, then `config` as resolved (`${` in a value is
    escaped, so a path holding it stays literal), and where Hydra keeps its own log."""
    _, schema = APPS[app]
    text = OmegaConf.to_yaml(OmegaConf.create(_escaped(config)))
    hydra = OmegaConf.to_yaml({"hydra": {"run": {"dir": str(hydra_dir)}, "job": {"chdir": False}}})
    path = config_dir / "stage.yaml"
    path.write_text(f"defaults:\n  - {schema}\n  - _self_\n\n{text}\n{hydra}")
    return path


def launch_app(app: str, config: dict[str, Any], accelerate_config: Path, hydra_dir: Path) -> None:
    """Run `app` under `accelerate launch` with `config`; its output streams to this terminal.

    Raises:
        RuntimeError: naming the app, the exit status and the command, if the launched run fails.
    """
    with tempfile.TemporaryDirectory(prefix=f"specdecode-{app}-") as config_dir:
        write_stage_config(app, config, Path(config_dir), hydra_dir)
        command = launch_command(app, accelerate_config, Path(config_dir), str(config.get("device", "cpu")))
        # The demo's working directory, not the repo's: relative paths in `config` mean the same.
        completed = subprocess.run(command, check=False)
    if completed.returncode != 0:
        raise RuntimeError(f"{app} under accelerate launch exited with status {completed.returncode}: {' '.join(command)}")
