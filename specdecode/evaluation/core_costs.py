"""The step costs of each decode core: a target step, a verify and a drafter step, as the speedup
model reads them (`StepCosts`: c, the verify ratio), timed on the eager, static and compiled cores.

Speculative decoding pays for itself when a drafter step is cheap next to a target step (c), and a
core that speeds the target up more than the drafter raises c. So each core times, at batch 1 in
the middle of an answer (the prompt plus half of `new_tokens` committed), on its own caches:

* a target step: one token through the target, on a cache the size the target alone decodes with;
* a verify: the pending token and gamma drafts through the target, accepted greedily, the target's
  features kept where the drafter reads them (`verify_drafts`, as a round runs it);
* a draft: the drafting strategy's gamma drafts (`Drafting.propose`, as a round runs it); the
  drafter's step is a gamma-th of it (for a feature drafter that includes its first window, the
  gamma + 1 positions whose true features are new).

On the compiled core each of the three is its own compiled graph, so what a whole round fuses
across them is not in these figures; the decode benchmark times whole rounds. The cores take
turns within each round of timing, and the first two rounds (compiling, guards) are not counted.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from specdecode.decoding.attention import folded_gqa
from specdecode.decoding.cache import RaggedKVCache, cached_forward
from specdecode.decoding.compiled import check_core, compiled_function, mark_step, nested_layers, skipped_guards
from specdecode.decoding.drafting import Drafting, drafting_for
from specdecode.decoding.sampling import SamplingParams
from specdecode.decoding.static import GUARDED_STEPS
from specdecode.decoding.static_buffers import fresh_zeros, mark_static, static_zeros
from specdecode.decoding.static_cache import StaticKVCache, static_capacity
from specdecode.decoding.timing import StepCosts
from specdecode.decoding.verify import verify_drafts
from specdecode.models.feature_drafter import FeatureDrafter

# The decode cores, as the options of `speculative_generate` / `autoregressive_generate`.
CORES = {
    "eager": dict(static=False),
    "static": dict(static=True, compile=False),
    "compiled": dict(static=True, compile=True),
}
GREEDY = SamplingParams()


def _target_step(target: PreTrainedModel, cache: RaggedKVCache | StaticKVCache, token: torch.Tensor) -> torch.Tensor:
    return cached_forward(target, cache, token).argmax(dim=-1)


def _verify(
    target: PreTrainedModel,
    cache: RaggedKVCache | StaticKVCache,
    drafting: Drafting,
    pending: torch.Tensor,
    draft: torch.Tensor,
    start: torch.Tensor,
) -> torch.Tensor:
    return verify_drafts(target, cache, drafting, pending, draft, None, start, GREEDY, None)[2]


def _draft(drafting: Drafting, tokens: torch.Tensor, lengths: torch.Tensor, length: int, gamma: int) -> torch.Tensor:
    return drafting.propose(tokens, lengths, length, gamma, GREEDY, None)[0]


# A timed piece: (put its state back, run it once) -> its output.
Piece = tuple[Callable[[], None], Callable[[], torch.Tensor]]


def _pieces(
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter,
    tokens: torch.Tensor,
    length: int,
    gamma: int,
    core: str,
    step_capacity: int,
) -> dict[str, Piece]:
    """The target step, verify and draft of one core, after `length` committed `tokens` `[1, S_cap]`
    (the target's caches hold all but the last, as at the start of a round or step): the
    speculative pieces on caches of S_cap slots, the target's step on one of `step_capacity`, the
    sizes each static core's decode gets."""
    static, compile = CORES[core]["static"], CORES[core].get("compile", False)
    device, capacity = target.device, tokens.shape[1]
    cache_type, zeros = StaticKVCache if static else RaggedKVCache, static_zeros if compile else fresh_zeros
    cache, step_cache = (cache_type.for_model(target, 1, size, zeros) for size in (capacity, step_capacity))
    drafting = drafting_for(drafter, cache_type.for_model(drafter, 1, capacity, zeros))
    cached_forward(target, step_cache, tokens[:, : length - 1], 1)
    out = cached_forward(target, cache, tokens[:, : length - 1], 1, feature_layers=drafting.feature_layers)
    hidden = out[1] if drafting.feature_layers is not None else None
    drafting.prefill(tokens, torch.tensor([length - 1], device=device), length - 1, hidden)
    if compile:
        mark_static(tokens)
    # a feature drafter's progress (`propose` sets the drafter's cache lengths from it; a slice
    # drafter's from its arguments)
    saved = {name: getattr(drafting, name) for name in ("start", "start_bound") if hasattr(drafting, name)}
    pending, draft = tokens[:, length - 1 : length], tokens[:, length : length + gamma]
    start, lengths = torch.tensor([length - 1], device=device), torch.tensor([length], device=device)

    def run(function: Callable, *args: object) -> Callable[[], torch.Tensor]:
        call = compiled_function(function, device) if compile else function
        return lambda: call(*args)

    def back(target_cache: RaggedKVCache | StaticKVCache) -> Callable[[], None]:
        return lambda: target_cache.set_lengths(start.clone(), length - 1)

    def drafter_back() -> None:
        for name, value in saved.items():
            setattr(drafting, name, value.clone() if isinstance(value, torch.Tensor) else value)

    return {
        "step": (back(step_cache), run(_target_step, target, step_cache, pending)),
        "verify": (back(cache), run(_verify, target, cache, drafting, pending, draft, start)),
        "draft": (drafter_back, run(_draft, drafting, tokens, lengths, length, gamma)),
    }


def _wait(device: torch.device) -> None:
    """Wait for the device's queued work (a CPU's ran as it was called)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _time_pieces(
    pieces: dict[tuple[str, str], Piece],
    repeats: int,
    compiled: set[str],
    device: torch.device,
    models: tuple[torch.nn.Module, ...],
) -> dict[tuple[str, str], float]:
    """Median seconds of each (core, piece), the pieces taking turns within each round; the first
    `GUARDED_STEPS` rounds (compiling, then guarded, as a decode's first steps) are not counted.
    A compiled core's pieces run with the decoder layers of `models` marked as a decode's are
    (`nested_layers`)."""
    times: dict[tuple[str, str], list[float]] = {key: [] for key in pieces}
    for round_ in range(GUARDED_STEPS + repeats):
        for (core, name), (back, run) in pieces.items():
            back()
            with nested_layers(*(models if core in compiled else ())):
                mark_step(core in compiled, device)
                _wait(device)
                with skipped_guards(core in compiled and round_ >= GUARDED_STEPS):
                    start = time.perf_counter()
                    run()
                    _wait(device)
                    times[core, name].append(time.perf_counter() - start)
    return {key: statistics.median(seconds[GUARDED_STEPS:]) for key, seconds in times.items()}


@torch.inference_mode()
def core_step_costs(
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter,
    prompt: Sequence[int],
    new_tokens: int,
    gamma: int,
    cores: Sequence[str] = tuple(CORES),
    repeats: int = 10,
) -> dict[str, StepCosts]:
    """core → its `StepCosts` (c, the verify ratio) for `drafter` at `gamma`, at batch 1 with `prompt`
    and half of `new_tokens` committed, on caches as large as a decode of `new_tokens` after `prompt`
    gets (see the module docstring).

    Raises:
        ValueError: an unknown core, an empty prompt, gamma or new_tokens below 1 or repeats below 1.
        RuntimeError: a compiled core on a torch that cannot compile it (`compiled.check_core`).
    """
    unknown = [core for core in cores if core not in CORES]
    if unknown or not cores:
        raise ValueError(f"cores must be one or more of {list(CORES)}, got {list(cores)}")
    for name, value in (("gamma", gamma), ("new_tokens", new_tokens), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not prompt:
        raise ValueError("prompt must hold one or more tokens")
    compiled = {core for core in cores if check_core(CORES[core]["static"], CORES[core].get("compile"), target.device)}
    length = len(prompt) + max(new_tokens // 2, 1)
    # the slots a decode's static caches get: `slack` past the budget as in `static_cache.rows_capacity`
    capacity = static_capacity(len(prompt) + new_tokens + gamma + 2)
    step_capacity = static_capacity(len(prompt) + new_tokens + 1)
    ids = (list(prompt) * (capacity // len(prompt) + 1))[:capacity]
    tokens = torch.tensor([ids], device=target.device)
    with folded_gqa(target, drafter):
        pieces = {
            (core, name): piece
            for core in cores
            for name, piece in _pieces(target, drafter, tokens.clone(), length, gamma, core, step_capacity).items()
        }
        times = _time_pieces(pieces, repeats, compiled, target.device, (target, drafter))
    return {
        core: StepCosts(
            target_step_s=times[core, "step"],
            target_verify_s=times[core, "verify"],
            drafter_step_s=times[core, "draft"] / gamma,
            gamma=gamma,
            context_tokens=length,
        )
        for core in cores
    }


def costs_markdown(costs: dict[str, dict[str, StepCosts]]) -> str:
    """A table of `core_step_costs` per drafter: drafter name → core → costs."""
    lines = [
        "| drafter | core | target step ms | verify ms | drafter step ms | c | verify ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for drafter, by_core in costs.items():
        for core, c in by_core.items():
            lines.append(
                f"| {drafter} | {core} | {c.target_step_s * 1e3:.2f} | {c.target_verify_s * 1e3:.2f} | "
                f"{c.drafter_step_s * 1e3:.2f} | {c.cost_ratio:.3f} | {c.verify_ratio:.2f} |"
            )
    return "\n".join(lines)
