"""Which CPU kernel a model's linear layers take (`cpu_matmul.py`): measured once per machine, then
read from a cache on disk.

Which kernel is fastest depends on the CPU, so it is measured where asked (`load_model`'s
`skinny_matmul=None`; the default `False` takes none of this): `measure_skinny_rows` times a
batch-1 forward of 1..5 tokens with skinny linears and with `F.linear`, the single row and the few
rows decided apart, since each kernel choice only touches its own row counts. That takes seconds
for SmolLM2-135M on a 2-core CPU, so `cached_skinny_rows` keeps the pick in `kernel_cache_dir()`,
one JSON file per key: the CPU model, the cores and torch threads, the torch version, the model's
dtype and linear shapes, and what was timed. A later load on the same machine reads the pick.
Delete the folder to measure again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from specdecode.core.atomic import write_atomic
from specdecode.models.cpu_matmul import (
    FEW_ROWS,
    SKINNY_MAX_ROWS,
    skinny_rows_of,
    use_plain_linears,
    use_skinny_linears,
)
from specdecode.models.gguf_cache import cache_dir

# The pass widths the skinny choice times: a decode step, and verify passes of gamma + 1 tokens for gamma 1..4.
AUTO_WIDTHS = (1, 2, 3, 4, 5)
# A single row's kernels are timed over this many times the rounds of the wider passes: they differ
# by ~10-14% where the few rows' differ by ~2x, and five rounds' medians then picked the slower one
# now and then; a one-token pass is the cheapest to time.
SINGLE_ROW_ROUNDS = 3
# The folder of kept picks, in place of `kernel_cache_dir()`'s default.
KERNEL_CACHE_ENV = "SPECDECODE_KERNEL_CACHE"

Rows = tuple[int, int] | None


def kernel_cache_dir() -> Path:
    """`$SPECDECODE_KERNEL_CACHE`, default `<specdecode cache>/cpu_kernels` (`$SPECDECODE_CACHE`,
    default `~/.cache/specdecode`)."""
    return Path(os.environ.get(KERNEL_CACHE_ENV) or cache_dir() / "cpu_kernels").expanduser()


def cpu_model() -> str:
    """This machine's CPU model: /proc/cpuinfo's `model name`, else `platform.processor()`."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def kernel_key(model: nn.Module, kind: str, **timed: Any) -> dict[str, Any]:
    """What a kernel pick of `kind` for `model` depends on: the machine, torch, the model's linear
    shapes and dtype, the kernels it already has, and what was timed (`timed`)."""
    shapes = Counter(tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear))
    return {
        "kind": kind,
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "model": type(model).__name__,
        "dtype": str(next(model.parameters()).dtype),
        "linears": sorted([*shape, count] for shape, count in shapes.items()),
        "skinny_rows": skinny_rows_of(model),
    } | timed


def cached_figures(key: dict[str, Any], measure: Callable[[], Any], remeasure: bool = False) -> Any:
    """The JSON figures kept for `key` in `kernel_cache_dir()`, else (or with `remeasure`)
    `measure()`'s, then kept there (a folder that cannot be written leaves them unkept: measured
    again next time)."""
    text = json.dumps(key, sort_keys=True)
    path = kernel_cache_dir() / f"{hashlib.sha256(text.encode()).hexdigest()[:20]}.json"
    if not remeasure:
        try:
            kept = json.loads(path.read_text())
            if kept["key"] == json.loads(text):
                return kept["figures"]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not measured yet here, or an unreadable file: measured again
    figures = measure()
    try:
        write_atomic(path, json.dumps({"key": json.loads(text), "figures": figures}) + "\n")
    except OSError:
        pass
    return figures


def cached_rows(key: dict[str, Any], measure: Callable[[], Rows]) -> Rows:
    """The skinny rows kept for `key` (`cached_figures`), else `measure()`'s."""
    rows = cached_figures(key, lambda: None if (r := measure()) is None else list(r))
    return None if rows is None else (int(rows[0]), int(rows[1]))


def cached_skinny_rows(model: PreTrainedModel) -> Rows:
    """`measure_skinny_rows(model)`, measured once per machine and model shape (module docstring)."""
    return cached_rows(kernel_key(model, "skinny", widths=AUTO_WIDTHS), lambda: measure_skinny_rows(model))


def _use_kernel(model: nn.Module, rows: Rows) -> None:
    if rows is not None:
        use_skinny_linears(model, rows)
    else:
        use_plain_linears(model)


def time_kernels(
    model: PreTrainedModel, widths: tuple[int, ...], repeats: int, use: Callable[[bool], None]
) -> dict[bool, dict[int, list[float]]]:
    """Seconds of a batch-1 forward of each of `widths` tokens with `use(False)`'s and `use(True)`'s
    kernels, `repeats + 1` rounds (the kernels take turns within each round, so a drifting machine
    biases both alike; the first round warms up and `is_faster` drops it)."""
    vocab = model.config.get_text_config().vocab_size
    inputs = {w: (torch.arange(w, device=model.device) % vocab).unsqueeze(0) for w in widths}
    times: dict[bool, dict[int, list[float]]] = {kernel: {w: [] for w in widths} for kernel in (False, True)}
    for _ in range(repeats + 1):
        for kernel in (False, True):
            use(kernel)
            for width, ids in inputs.items():
                start = time.perf_counter()
                model(input_ids=ids)
                times[kernel][width].append(time.perf_counter() - start)
    return times


def is_faster(times: dict[bool, dict[int, list[float]]], chosen: list[int]) -> bool:
    """Whether the `True` kernel beats the `False` one over the `chosen` widths: the median, over the
    rounds after the warm-up, of the ratio of their summed times in the same round, below 1. The
    kernels take turns within a round, so each round's ratio cancels the machine's drift (one
    width's median can move by half across timings on a shared CPU)."""
    if not chosen:
        return False
    rounds = range(1, len(times[True][chosen[0]]))
    ratios = [sum(times[True][w][r] for w in chosen) / sum(times[False][w][r] for w in chosen) for r in rounds]
    return statistics.median(ratios) < 1


@torch.inference_mode()
def measure_skinny_rows(model: PreTrainedModel, widths: tuple[int, ...] = AUTO_WIDTHS, repeats: int = 5) -> Rows:
    """Which row counts skinny linears make faster than `F.linear` in `model`'s passes on this CPU.

    Times a batch-1 forward of each of `widths` tokens with both kernels (`time_kernels`; the
    one-token pass over `SINGLE_ROW_ROUNDS` times the rounds). A single row and the few rows of a
    verify pass are decided apart (`is_faster`), each kernel touching only its own row counts.
    Returns the rows for `use_skinny_linears` (`(1, 64)`, `FEW_ROWS` or `(1, 1)`), None where
    `F.linear` won both. `model` comes back with the kernels it had.
    """
    had = skinny_rows_of(model)

    def use(skinny: bool) -> None:
        _use_kernel(model, (1, SKINNY_MAX_ROWS) if skinny else None)

    wide = tuple(w for w in widths if w > 1)
    single = 1 in widths and is_faster(time_kernels(model, (1,), SINGLE_ROW_ROUNDS * repeats, use), [1])
    few = bool(wide) and is_faster(time_kernels(model, wide, repeats, use), list(wide))
    _use_kernel(model, had)
    if single and few:
        return (1, SKINNY_MAX_ROWS)
    return FEW_ROWS if few else (1, 1) if single else None
