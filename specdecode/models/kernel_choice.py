"""The CPU kernel of a model's linear layers where asked (`skinny_matmul=None`): batch-1 forwards
of 1..5 tokens timed with both kernels, the pick kept in `kernel_cache_dir()` per CPU, threads,
torch, dtype and linear shapes. Delete the folder to measure again.
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
# A single row's kernels differ by ~10-14% (the few rows' by ~2x): timed over this many times the rounds.
SINGLE_ROW_ROUNDS = 3
# The folder of kept picks, in place of `kernel_cache_dir()`'s default.
KERNEL_CACHE_ENV = "SPECDECODE_KERNEL_CACHE"

Rows = tuple[int, int] | None


def kernel_cache_dir() -> Path:
    """`$SPECDECODE_KERNEL_CACHE`, default `<specdecode cache>/cpu_kernels`."""
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
    `measure()`'s, then kept there if the folder can be written."""
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
    kernels, taking turns within each of `repeats + 1` rounds (the first warms up)."""
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
    """Whether the `True` kernel beats the `False` one over the `chosen` widths: the median over the
    rounds after the warm-up of their summed times' ratio in one round (which cancels drift) < 1."""
    if not chosen:
        return False
    rounds = range(1, len(times[True][chosen[0]]))
    ratios = [sum(times[True][w][r] for w in chosen) / sum(times[False][w][r] for w in chosen) for r in rounds]
    return statistics.median(ratios) < 1


@torch.inference_mode()
def measure_skinny_rows(model: PreTrainedModel, widths: tuple[int, ...] = AUTO_WIDTHS, repeats: int = 5) -> Rows:
    """Which row counts skinny linears make faster than `F.linear` in `model`'s passes on this CPU,
    a single row and the few rows of a verify pass decided apart: `(1, 64)`, `FEW_ROWS`, `(1, 1)`
    or None. `model` comes back with the kernels it had."""
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
