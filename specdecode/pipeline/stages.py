"""Stages cached by their resolved config: the demo's train → collect → fit → eval chain.

A stage's key is a hash of its own config and its upstream stages' keys, so re-running skips a
finished stage whose config is unchanged, and a changed config reruns that stage and everything
downstream. A stage writes into a temp folder that is renamed into place with its key file written
last: a stage killed half-way is never taken as finished.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from specdecode.core.atomic import atomic_folder

_KEY_FILE = "STAGE.json"


@dataclass
class Stage:
    """`run(config, out_dir)` does the work, writing its outputs under `out_dir`."""

    name: str
    config: dict
    run: Callable[[dict, Path], object]
    after: list[str] = field(default_factory=list)


def stage_key(stage: Stage, upstream_keys: list[str]) -> str:
    payload = json.dumps({"config": stage.config, "upstream": upstream_keys}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def finished_key(out_dir: Path) -> str | None:
    marker = out_dir / _KEY_FILE
    return json.loads(marker.read_text())["key"] if marker.is_file() else None


def run_stages(stages: list[Stage], root: Path) -> dict[str, Path]:
    """Run `stages` (listed in dependency order) under `root`; return each stage's output folder."""
    names = [s.name for s in stages]
    for stage in stages:
        for dep in stage.after:
            if dep not in names[: names.index(stage.name)]:
                raise ValueError(f"stage {stage.name!r} runs after {dep!r}, which is not an earlier stage")
    keys: dict[str, str] = {}
    outputs: dict[str, Path] = {}
    bar = tqdm(stages, desc="pipeline", unit="stage")
    for stage in bar:
        key = stage_key(stage, [keys[d] for d in stage.after])
        keys[stage.name] = key
        out = root / stage.name
        outputs[stage.name] = out
        if finished_key(out) == key:
            bar.write(f"[{stage.name}] up to date ({key}), skipped")
            continue
        bar.set_postfix_str(stage.name)
        # The old output is replaced only once the new one is complete.
        with atomic_folder(out) as tmp:
            start = time.perf_counter()
            stage.run(stage.config, tmp)
            seconds = time.perf_counter() - start
            (tmp / _KEY_FILE).write_text(json.dumps({"key": key, "config": stage.config, "seconds": seconds}, default=str))
        bar.write(f"[{stage.name}] done in {seconds:.0f} s ({key})")
    return outputs
