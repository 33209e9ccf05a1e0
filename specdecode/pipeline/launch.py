"""Run an app under `accelerate launch` on a config the demo composed, written as a one-file config
folder naming the app's schema; a launched stage runs under `watchdog.py` and dies with the demo.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from specdecode.pipeline.config import CONF_DIR
from specdecode.pipeline.watchdog import GRACE_SECONDS

ROOT = CONF_DIR.parent
WATCHDOG = Path(__file__).with_name("watchdog.py")
# Each launched app's script, ConfigStore schema, and `specdecode` command (a wheel ships no scripts).
APPS: dict[str, tuple[str, str, str]] = {
    "distill": ("train/distill.py", "train_job_schema", "train"),
    "finetune": ("train/finetune.py", "train_job_schema", "finetune"),
    "eval": ("eval/acceptance.py", "eval_schema", "eval"),
}


def launch_command(app: str, accelerate_config: Path, config_dir: Path, device: str = "cpu") -> list[str]:
    """`python -m accelerate.commands.launch --config_file <file> <app> --config-path <dir> --config-name
    stage`; a single process on `cuda:N` gets `--gpu_ids all` (the app honours N itself)."""
    script, _, command = APPS[app]
    single = OmegaConf.select(OmegaConf.load(accelerate_config), "num_processes", default=1) == 1
    gpu_ids = ["--gpu_ids", "all"] if single and device.startswith("cuda:") else []
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(accelerate_config),
        *gpu_ids,
        *_program(script, command),
        "--config-path",
        str(config_dir),
        "--config-name",
        "stage",
    ]


def _program(script: str, command: str) -> list[str]:
    """The app's script in a checkout; in an installed wheel, the `specdecode` command's module."""
    if (ROOT / script).is_file():
        return [str(ROOT / script)]
    return ["-m", "specdecode.pipeline.cli", command]


def map_strings(value: Any, change: Callable[[str], str]) -> Any:
    """`value` (nested dicts and lists) with `change` applied to each string in it."""
    if isinstance(value, dict):
        return {k: map_strings(v, change) for k, v in value.items()}
    if isinstance(value, list):
        return [map_strings(v, change) for v in value]
    return change(value) if isinstance(value, str) else value


def write_stage_config(app: str, config: dict[str, Any], config_dir: Path, hydra_dir: Path) -> Path:
    """`<config_dir>/stage.yaml`: the app's schema, then `config` as resolved (`${` escaped, so OmegaConf
    reads it back literally), and Hydra's log folder."""
    _, schema, _ = APPS[app]
    text = OmegaConf.to_yaml(OmegaConf.create(map_strings(config, lambda s: s.replace("${", "\\${"))))
    hydra = OmegaConf.to_yaml({"hydra": {"run": {"dir": str(hydra_dir)}, "job": {"chdir": False}}})
    path = config_dir / "stage.yaml"
    path.write_text(f"defaults:\n  - {schema}\n  - _self_\n\n{text}\n{hydra}")
    return path


def run_tied(command: list[str]) -> int:
    """Run `command` to its end → its exit status; its process group dies with this process."""
    process = subprocess.Popen([sys.executable, str(WATCHDOG), str(os.getpid()), *command], start_new_session=True)
    try:
        return process.wait()
    finally:
        if process.returncode is None:
            process.terminate()  # the watchdog ends its group: SIGTERM, then SIGKILL
            try:
                process.wait(timeout=GRACE_SECONDS + 5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)  # the watchdog leads the group: pgid == its pid
                process.wait()


def launch_app(app: str, config: dict[str, Any], accelerate_config: Path, hydra_dir: Path) -> None:
    """Run `app` under `accelerate launch` with `config`, tied to this process; a RuntimeError names a failed run."""
    with tempfile.TemporaryDirectory(prefix=f"specdecode-{app}-") as config_dir:
        write_stage_config(app, config, Path(config_dir), hydra_dir)
        command = launch_command(app, accelerate_config, Path(config_dir), str(config.get("device", "cpu")))
        # The demo's working directory, not the repo's: relative paths in `config` mean the same.
        returncode = run_tied(command)
    if returncode != 0:
        raise RuntimeError(f"{app} under accelerate launch exited with status {returncode}: {' '.join(command)}")
