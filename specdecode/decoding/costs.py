"""The one timer of a decode step's pieces (`step_pieces`, `time_rounds`: the pieces take turns within
each round, so drift biases all alike), and the step table the adaptive gamma reads: a step of g drafts
at each batch size, kept in `$SPECDECODE_CACHE` by machine, torch, models and sampling mode, and
measured again where a once-per-process spot check is off by more than `STALE_FACTOR`.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import statistics
import time
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch
from transformers import PreTrainedModel

from specdecode.core.config import is_int
from specdecode.decoding.attention import folded_gqa
from specdecode.decoding.cache import KVCache, RaggedKVCache, cached_forward_features
from specdecode.decoding.compiled import compiled_function
from specdecode.decoding.drafting import Drafting, drafting_for
from specdecode.decoding.sampling import Generator, Params, SamplingParams, next_tokens
from specdecode.decoding.static_buffers import fresh_zeros, mark_static, static_zeros
from specdecode.decoding.static_cache import StaticKVCache
from specdecode.decoding.verify import verify_drafts
from specdecode.models.feature_drafter import FeatureDrafter
from specdecode.models.kernel_choice import cached_figures, kernel_cache_dir, kernel_key

# The decode cores, as the options of `speculative_generate` / `autoregressive_generate`.
CORES: dict[str, dict[str, bool]] = {
    "eager": dict(static=False),
    "static": dict(static=True, compile=False),
    "compiled": dict(static=True, compile=True),
}
# A timed piece: (put its state back, run it once).
Piece = tuple[Callable[[], None], Callable[[], object]]
Key = TypeVar("Key", bound=Hashable)


def check_counts(*checks: tuple[str, object, int]) -> None:
    """Raise ValueError naming the first `(name, value, low)` whose value is not an int >= low."""
    for name, value, low in checks:
        if not is_int(value) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def wait_for(device: torch.device) -> None:
    """Wait for the device's queued work (a CPU's ran as it was called)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def time_rounds(
    pieces: Mapping[Key, Piece],
    repeats: int,
    device: torch.device,
    warm_up: int = 1,
    around: Callable[[Key, int], contextlib.AbstractContextManager[object]] | None = None,
) -> dict[Key, float]:
    """Median seconds of each piece over `repeats` rounds after `warm_up` uncounted ones, the pieces
    taking turns within each round; each call runs from its state put back, inside
    `around(key, round)` where given."""
    times: dict[Key, list[float]] = {key: [] for key in pieces}
    for round_ in range(warm_up + repeats):
        for key, (back, run) in pieces.items():
            back()
            with around(key, round_) if around is not None else contextlib.nullcontext():
                wait_for(device)
                start = time.perf_counter()
                run()
                wait_for(device)
                times[key].append(time.perf_counter() - start)
    return {key: statistics.median(seconds[warm_up:]) for key, seconds in times.items()}


def step_pieces(
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter | None,
    tokens: torch.Tensor,
    length: int,
    gammas: Sequence[int],
    params: SamplingParams = SamplingParams(),
    core: str = "eager",
    step_capacity: int | None = None,
) -> dict[tuple[str, int], Piece]:
    """The pieces of a step after `length` committed `tokens` `[B, S_cap]`, drawing as `params` does:
    `("step", 0)` the target's step, and for each g of `gammas` `("verify", g)`, a verify of the g
    tokens after the pending one (sampled: against a uniform q), and `("draft", g)`, the drafter's g
    drafts (none without a drafter). The caches are `core`'s, of S_cap slots (the target step's of
    `step_capacity` where given)."""
    static, compile = CORES[core]["static"], CORES[core].get("compile", False)
    if compile and not params.greedy:
        raise ValueError(f"compiled pieces draw greedily (a graph draws from no generator), got {params!r}")
    device, (batch_size, capacity) = target.device, tokens.shape
    kind, zeros = StaticKVCache if static else RaggedKVCache, static_zeros if compile else fresh_zeros
    cache = kind.for_model(target, batch_size, capacity, zeros)
    step_cache = cache if step_capacity is None else kind.for_model(target, batch_size, step_capacity, zeros)
    # without a drafter: the target's own strategy, never run, which keeps no features
    model = target if drafter is None else drafter
    drafting = drafting_for(model, kind.for_model(model, batch_size, capacity, zeros))
    start = torch.full((batch_size,), length - 1, device=device)
    if step_cache is not cache:
        cached_forward_features(target, step_cache, tokens[:, : length - 1], 1)
    _, hidden = cached_forward_features(
        target, cache, tokens[:, : length - 1], 1, feature_layers=drafting.feature_layers
    )
    if drafter is not None:
        drafting.prefill(tokens, start, length - 1, hidden)
    if compile:
        mark_static(tokens)
    restore = drafting.snapshot()  # the drafter's progress: `propose` moves it
    pending, vocab_size = tokens[:, length - 1 : length], target.config.vocab_size
    generator = None if params.greedy else torch.Generator(device=device).manual_seed(0)

    def run(function: Callable[..., torch.Tensor], *args: object) -> Callable[[], object]:
        call = compiled_function(function, device) if compile else function
        return lambda: call(*args, params, generator)

    def back(target_cache: KVCache) -> Callable[[], None]:
        return lambda: target_cache.set_lengths(start.clone(), length - 1)

    pieces = {("step", 0): (back(step_cache), run(_target_step, target, step_cache, pending))}
    for g in gammas:
        q = None if params.greedy else torch.full((batch_size, g, vocab_size), 1 / vocab_size, device=device)
        draft = tokens[:, length : length + g]
        pieces["verify", g] = (back(cache), run(_verify, target, cache, drafting, pending, draft, q, start))
        if drafter is not None:
            pieces["draft", g] = (restore, run(_draft, drafting, tokens, start + 1, length, g))
    return pieces


def _target_step(
    target: PreTrainedModel, cache: KVCache, pending: torch.Tensor, params: Params, generator: Generator
) -> torch.Tensor:
    return next_tokens(cached_forward_features(target, cache, pending, 1)[0], params, generator)


def _verify(*args: Any) -> torch.Tensor:
    """`verify_drafts(*args)`'s new tokens `[B, gamma + 1]`."""
    return verify_drafts(*args)[2]


def _draft(drafting: Drafting, *args: Any) -> torch.Tensor:
    """`drafting.propose(*args)`'s drafts `[B, gamma]`."""
    return drafting.propose(*args)[0]


# The batch sizes and the widest gamma timed by default: a serving batch past 8 is extrapolated.
COST_BATCH_SIZES = (1, 2, 4, 8)
COST_MAX_GAMMA = 6
# An answer's middle: a prompt of ~100 tokens and half of a 128-token answer.
COST_CONTEXT_TOKENS = 160
COST_REPEATS = 5
# A kept table whose spot-checked steps are off by more than this factor is measured again.
STALE_FACTOR = 1.3
SPOT_REPEATS = 3


@dataclass(frozen=True)
class StepTable:
    """Seconds of one decode step: `seconds[b][g]` at batch `batch_sizes[b]` with g drafts (g = 0:
    the target alone), measured at `context_tokens` committed tokens per row; `drafts[b][g]` the
    drafter's share of it (empty: not timed apart), which a mixed batch pays once per drafter."""

    batch_sizes: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]
    context_tokens: int
    drafts: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.batch_sizes or list(self.batch_sizes) != sorted(set(self.batch_sizes)) or self.batch_sizes[0] < 1:
            raise ValueError(f"batch_sizes must be ascending distinct ints >= 1, got {self.batch_sizes!r}")
        widths = {len(row) for row in self.seconds}
        if len(self.seconds) != len(self.batch_sizes) or len(widths) != 1 or min(widths) < 1:
            raise ValueError("seconds must hold one row per batch size, each with one figure per gamma 0..G")
        if any(not s > 0 for row in self.seconds for s in row):
            raise ValueError(f"every step cost must be > 0 seconds, got {self.seconds!r}")
        shares = [(d, s) for drafts, row in zip(self.drafts, self.seconds) for d, s in zip(drafts, row)]
        if self.drafts and (
            [len(row) for row in self.drafts] != [len(row) for row in self.seconds]
            or any(not 0 <= d <= s for d, s in shares)
        ):
            raise ValueError(f"drafts must be empty or, like seconds, each in [0, its step's], got {self.drafts!r}")

    @property
    def max_gamma(self) -> int:
        return len(self.seconds[0]) - 1

    def at(self, batch_size: int) -> list[float]:
        """Seconds per step at each gamma 0..G for `batch_size` rows: linear between the measured
        batch sizes, extended along the last two past the largest (the first alone below two)."""
        return [max(s, 1e-9) for s in self._along(self.seconds, batch_size)]

    def drafts_at(self, batch_size: int) -> list[float]:
        """The drafter's seconds of each step 0..G at `batch_size` rows, as `at` reads `seconds`."""
        if not self.drafts:
            raise ValueError("this table did not time the drafts apart (drafts is empty)")
        return [max(d, 0.0) for d in self._along(self.drafts, batch_size)]

    def _along(self, rows: tuple[tuple[float, ...], ...], batch_size: int) -> list[float]:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        sizes = self.batch_sizes
        if len(sizes) == 1 or batch_size <= sizes[0]:
            return list(rows[0])
        i = min(bisect.bisect_left(sizes, batch_size), len(sizes) - 1)
        (b0, b1), (s0, s1) = (sizes[i - 1], sizes[i]), (rows[i - 1], rows[i])
        w = (batch_size - b0) / (b1 - b0)
        return [x + w * (y - x) for x, y in zip(s0, s1)]

    def relative(self, batch_size: int) -> list[float]:
        """`at(batch_size)` in target steps (gamma 0 is 1)."""
        seconds = self.at(batch_size)
        return [s / seconds[0] for s in seconds]

    def agrees(self, target_s: float, widest_s: float, factor: float = STALE_FACTOR) -> bool:
        """Whether a target step of `target_s` and a widest step of `widest_s` seconds (smallest batch
        size) are within `factor` of this table's, the widest in target steps."""
        row = self.seconds[0]
        now, kept = (target_s, widest_s / target_s), (row[0], row[-1] / row[0])
        return all(max(a / b, b / a) <= factor for a, b in zip(now, kept))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepTable:
        return cls(
            tuple(int(b) for b in data["batch_sizes"]),
            tuple(tuple(float(s) for s in row) for row in data["seconds"]),
            int(data["context_tokens"]),
            tuple(tuple(float(d) for d in row) for row in data.get("drafts", ())),
        )


@torch.inference_mode()
def measure_step_table(
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter,
    params: SamplingParams = SamplingParams(),
    batch_sizes: Sequence[int] = COST_BATCH_SIZES,
    max_gamma: int = COST_MAX_GAMMA,
    context_tokens: int = COST_CONTEXT_TOKENS,
    repeats: int = COST_REPEATS,
) -> StepTable:
    """Time a target step and a step of 1..`max_gamma` drafts (drafts and verify timed apart) at each
    of `batch_sizes`, drawing tokens as `params` does."""
    check_counts(("max_gamma", max_gamma, 1), ("context_tokens", context_tokens, 2), ("repeats", repeats, 1))
    sizes = tuple(sorted(set(batch_sizes)))
    if not sizes or any(not is_int(b) or b < 1 for b in sizes):
        raise ValueError(f"batch_sizes must be one or more ints >= 1, got {list(batch_sizes)!r}")
    times = _table_times(target, drafter, params, sizes, range(1, max_gamma + 1), context_tokens, repeats)
    seconds = tuple(tuple(_step_s(times, b, g) for g in range(max_gamma + 1)) for b in sizes)
    drafts = tuple(tuple(times[b, "draft", g] if g else 0.0 for g in range(max_gamma + 1)) for b in sizes)
    return StepTable(sizes, seconds, context_tokens, drafts)


def _table_times(
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter,
    params: SamplingParams,
    batch_sizes: Sequence[int],
    gammas: Sequence[int],
    context_tokens: int,
    repeats: int,
) -> dict[tuple[int, str, int], float]:
    """(b, name, g) → the median seconds of `step_pieces`' (name, g) at each batch size b, on seeded
    random rows of `context_tokens` committed tokens."""
    device, capacity = target.device, context_tokens + max(gammas) + 2
    generator = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (1, capacity), generator=generator, device=device)
    pieces: dict[tuple[int, str, int], Piece] = {}
    with folded_gqa(target, drafter):
        for b in batch_sizes:
            built = step_pieces(target, drafter, ids.expand(b, -1).contiguous(), context_tokens, gammas, params)
            pieces |= {(b, name, g): piece for (name, g), piece in built.items()}
        return time_rounds(pieces, repeats, device)


def _step_s(times: Mapping[tuple[int, str, int], float], b: int, g: int) -> float:
    """Seconds of a step of g drafts at batch b: the target's step for g = 0, else drafts + verify."""
    return times[b, "step", 0] if g == 0 else times[b, "draft", g] + times[b, "verify", g]


def step_table(
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter,
    params: SamplingParams = SamplingParams(),
    max_gamma: int = COST_MAX_GAMMA,
    remeasure: bool = False,
    **measure: Any,
) -> StepTable:
    """`measure_step_table` for this machine and these models, cached and spot-checked (module
    docstring); `remeasure` times it again."""
    sizes = tuple(measure.get("batch_sizes", COST_BATCH_SIZES))
    context = measure.get("context_tokens", COST_CONTEXT_TOKENS)
    sampling = "greedy" if params.greedy else f"sampled by the CDF, top_k={params.top_k > 0} top_p={params.top_p < 1.0}"
    # what a table depends on: the machine, torch, both models, the sampling mode, what was timed
    # (`step`: a step's seconds are its drafts' and its verify's, timed apart, `_step_s`)
    timed = dict(batch_sizes=list(sizes), max_gamma=max_gamma, context_tokens=context, step="draft+verify, drafts kept")
    key = kernel_key(target, "step_costs", device=str(target.device), sampling=sampling, **timed)
    key["drafter"] = kernel_key(drafter, "drafter")
    checked = f"{kernel_cache_dir()} {json.dumps(key, sort_keys=True)}"
    if not remeasure and checked in _CHECKED:
        return _CHECKED[checked]
    measured: list[StepTable] = []

    def run() -> dict[str, Any]:
        measured.append(measure_step_table(target, drafter, params, max_gamma=max_gamma, **measure))
        return measured[-1].to_dict()

    table = StepTable.from_dict(cached_figures(key, run, remeasure))
    if not measured:
        target_s, widest_s = spot_check(target, drafter, params, table)
        if not table.agrees(target_s, widest_s):
            warnings.warn(
                f"the kept step table is off this machine's steps (target step {1e3 * table.seconds[0][0]:.1f} ms "
                f"kept, {1e3 * target_s:.1f} ms now; widest step {table.relative(table.batch_sizes[0])[-1]:.2f} "
                f"target steps kept, {widest_s / target_s:.2f} now): measuring it again",
                stacklevel=2,
            )
            table = StepTable.from_dict(cached_figures(key, run, remeasure=True))
    _CHECKED[checked] = table
    return table


# Tables read or measured in this process, by cache folder and key: each kept table is checked once.
_CHECKED: dict[str, StepTable] = {}


@torch.inference_mode()
def spot_check(
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter,
    params: SamplingParams,
    table: StepTable,
    repeats: int = SPOT_REPEATS,
) -> tuple[float, float]:
    """Seconds of a target step and of a step of the table's widest gamma, at its smallest batch
    size and context, timed now as the table was."""
    batch, widest = table.batch_sizes[0], table.max_gamma
    times = _table_times(target, drafter, params, [batch], [widest], table.context_tokens, repeats)
    return _step_s(times, batch, 0), _step_s(times, batch, widest)
