"""Linear layers that stay memory-bound for a few rows on CPU: what makes a verify pass cheap.

A decode step multiplies one row per sequence by every weight matrix, so on a CPU it costs one
sweep of the weights through memory. A verify pass multiplies gamma + 1 rows, and should cost about
the same sweep. With `F.linear` it does not: for 2..16 rows MKL leaves its matrix-vector kernel for
a blocked GEMM that packs the weights first, and on the 2-core development machine a 2..9-row pass
over SmolLM2-135M's weights took 1.6-2.7x a 1-row pass (docs/results.md, "Measured with and without skinny
linears"). Computing the same
product as `weight @ x.T` (the weights as the left operand, the few rows as the narrow right one)
keeps MKL on a streaming kernel: a 4-row pass then costs about what a 1-row pass does.

The numbers are the same products summed by another kernel: results agree with `F.linear` to
float rounding, not bitwise, just as MKL's own 1-row and many-row kernels do not agree bitwise.
Training (inputs that need grad) and GPU tensors take the ordinary path.

A single row (every decode step of the target alone, every drafting step) is the other case: on
some CPUs MKL runs a matrix-vector product on one core only, so a 1-row pass takes longer than a
2-row one. Computed as two identical rows through the same `weight @ x.T`, it is a product MKL
splits across the cores; the copy of one row costs nothing. On the 2026-11-25 machine (2-core AMD
EPYC) that took SmolLM2-135M's one-token step from 60 to 38 ms (docs/results.md, "One row as two").

Which kernel is faster depends on the CPU, so the default is to measure (`measure_skinny_rows`, run
by `load_model` when `skinny_matmul` is None): the single row and the few rows are decided apart,
since each kernel choice only touches its own row counts. On the 2026-11-23 machine skinny linears
brought a 4-token verify from ~1.7x to ~1.1x a step; on the 2026-11-24 one (a 480 MB L3 cache
holding most of SmolLM2's weights, a one-token step of 31 ms instead of 58) they cost 2.0x at every
width while `F.linear` cost 1.03x for 2 rows, 1.07x for 3 and 1.5x for 4 (docs/results.md, "CPU kernels").

Past two rows MKL's `weight @ x.T` leaves its streaming kernel too: on the 2-core AMD EPYC a 3..5-row
product over SmolLM2's weights took ~25-32 ms where 2 rows took ~17, so a verify of gamma >= 2
drafts cost 1.3-1.5x a step and gamma 1 was the fastest. oneDNN's inner product over weights
reordered once into its blocked layout (`use_packed_linears`) streams them for 3..16 rows: ~21 ms
there, flat from 3 to 5 rows. The reordered copy costs the weights' memory again, kept beside them
(a single row and two rows stay faster on the plain weights), so it is only used where
`measure_packed_rows` timed it faster, on float32 CPU weights, and never for inputs that need grad.
On 2026-11-26 the same EPYC timed it ~11% slower than skinny linears for 3..5 rows (docs/results.md,
"`make demo` with the one-standard-error gamma rule"): the measurement, not the machine's name,
decides.
It is rebuilt whenever the weights change (training steps, `load_state_dict`), by their version.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

# Above this many rows (e.g. a prefill, a training batch) the blocked GEMM is the faster kernel.
SKINNY_MAX_ROWS = 64
# The pass widths the automatic choice times: a decode step, and verify passes of gamma + 1 tokens
# for gamma 1..4.
AUTO_WIDTHS = (1, 2, 3, 4, 5)
# The row counts a skinny linear takes, (lowest, highest): a verify pass's few rows, as `True` forces.
FEW_ROWS = (2, SKINNY_MAX_ROWS)
# The row counts oneDNN's reordered weights take where measured faster: verify passes of gamma 2..4
# at batch 1 (3..5 rows) up to batched ones; above, a prefill's many rows take the blocked GEMM.
PACKED_ROWS = (3, 16)
# The widths `measure_packed_rows` times: verify passes of gamma 2..4.
PACKED_WIDTHS = (3, 4, 5)
# A single row's kernels are timed over this many times the rounds of the wider passes: they differ
# by ~10-14% on the 2-core EPYC (the few rows' by ~2x), and five rounds' medians picked the slower one
# in 2 of 12 timings there, 15 rounds compared round by round in none (docs/results.md, "The one-row
# kernel pick, round by round"). A one-token pass is the cheapest to time.
SINGLE_ROW_ROUNDS = 3


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, rows: tuple[int, int] = FEW_ROWS
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, computed as `(weight @ x.T).T` when `x` has `rows[0]..rows[1]`
    rows (at most SKINNY_MAX_ROWS) on CPU; a single row goes through as two identical ones.

    Args:
        x: `[..., H_in]`.
        weight: `[H_out, H_in]`.
        bias: `[H_out]` or None.
        rows: the inclusive range of row counts that take this kernel; the others take `F.linear`.

    Returns:
        `[..., H_out]`.
    """
    count = x.numel() // max(x.shape[-1], 1)
    if (
        x.device.type != "cpu"
        or not rows[0] <= count <= min(rows[1], SKINNY_MAX_ROWS)
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return F.linear(x, weight, bias)
    # MKL's streaming kernel wants the narrow operand as the transpose of row-major rows, and the
    # layers after this one want row-major output (a transposed view would, e.g., give attention
    # queries a last-dim stride != 1 and push SDPA off its flash kernel): both copies are tiny.
    flat = x.reshape(count, x.shape[-1]).contiguous()
    if count == 1:
        # One column would be a matrix-vector product again, which MKL may run on one core; with
        # the row twice it is a product over two columns, split across the cores. Keep one.
        out = torch.mm(weight, flat.expand(2, -1).contiguous().t())[:, :1].t().contiguous()
    else:
        out = torch.mm(weight, flat.t()).t().contiguous()  # [rows, H_out]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def packed_available() -> bool:
    """Whether this torch build has oneDNN's reordered-weight inner product (x86 CPU wheels do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class SkinnyLinear(nn.Linear):
    """An `nn.Linear` whose forward is `skinny_linear` over its `skinny_rows` (None: `F.linear`),
    and oneDNN's product over reordered weights for its `packed_rows` (None: never); same
    parameters, state dict and checkpoints."""

    skinny_rows: tuple[int, int] | None = FEW_ROWS
    packed_rows: tuple[int, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._takes_packed(x):
            return self._packed_forward(x)
        if self.skinny_rows is None:
            return F.linear(x, self.weight, self.bias)
        return skinny_linear(x, self.weight, self.bias, self.skinny_rows)

    def _takes_packed(self, x: torch.Tensor) -> bool:
        count = x.numel() // max(x.shape[-1], 1)
        rows = self.packed_rows
        return (
            rows is not None and rows[0] <= count <= rows[1]
            and x.device.type == "cpu" and x.dtype == self.weight.dtype == torch.float32
            # no_grad / inference_mode only: oneDNN's op has no backward, and its reordered copy,
            # built under inference_mode, must not reach an autograd graph
            and not torch.is_grad_enabled()
        )

    def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """`F.linear` over `[..., H_in]` → `[..., H_out]` through the reordered weights, reordered
        again first if the weights changed since (an optimizer step or a load bumps their version;
        `.to()` moves their storage)."""
        key = (self.weight._version, self.weight.data_ptr())
        cached = self.__dict__.get("_packed")
        if cached is None or cached[0] != key:
            # The batch-size hint picks oneDNN's layout: any hint above 1 measured alike for 3..16
            # rows; hint 1 took 1.5-2x longer for them.
            with torch.no_grad():
                cached = (key, torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACKED_ROWS[0]))
            self.__dict__["_packed"] = cached
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(flat, cached[1], self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.weight.shape[0])

    def __getstate__(self) -> dict[str, object]:
        # deepcopy / pickle: the reordered copy is a cache, rebuilt on use (oneDNN tensors have no storage to copy)
        state = dict(super().__getstate__())
        state.pop("_packed", None)
        return state

    def drop_packed(self) -> None:
        """Free the reordered copy (it is rebuilt on the next call that takes it)."""
        self.__dict__.pop("_packed", None)


def use_skinny_linears(model: nn.Module, rows: tuple[int, int] = FEW_ROWS) -> int:
    """Switch every plain `nn.Linear` (or `SkinnyLinear`) in `model` to a `SkinnyLinear` over
    `rows` row counts, in place; return how many.

    Only the class changes (no copy, no new parameter), so tied weights stay tied and
    `save_pretrained` writes the same files. Subclasses of `nn.Linear` are left alone: their
    forward may do more than a matmul.
    """
    if not (len(rows) == 2 and 1 <= rows[0] <= rows[1] <= SKINNY_MAX_ROWS):
        raise ValueError(f"skinny rows must be (lowest, highest) with 1 <= lowest <= highest <= {SKINNY_MAX_ROWS}, got {rows!r}")
    count = 0
    for module in model.modules():
        if type(module) in (nn.Linear, SkinnyLinear):
            module.__class__ = SkinnyLinear
            module.skinny_rows = (int(rows[0]), int(rows[1]))
            count += 1
        elif _takes_skinny_rows(module):
            module.skinny_rows = (int(rows[0]), int(rows[1]))
    return count


def _takes_skinny_rows(module: nn.Module) -> bool:
    """A module that is no `nn.Linear` but runs its own product through `skinny_linear` over its
    `skinny_rows` (None: `F.linear`), e.g. a truncated draft head (`DraftVocabHead`)."""
    return not isinstance(module, nn.Linear) and "skinny_rows" in vars(type(module))


def use_packed_linears(model: nn.Module, rows: tuple[int, int] | None = PACKED_ROWS) -> int:
    """Let `rows` row counts of every linear layer in `model` take oneDNN's product over weights
    reordered once (None: none, the reordered copies freed), in place; return how many layers.

    A plain `nn.Linear` becomes a `SkinnyLinear` that takes the skinny kernel for no rows, so the
    other row counts keep `F.linear`. Raises ValueError on bad rows or where this torch build has
    no oneDNN."""
    if rows is not None:
        if not (len(rows) == 2 and 1 <= rows[0] <= rows[1] <= SKINNY_MAX_ROWS):
            raise ValueError(f"packed rows must be (lowest, highest) with 1 <= lowest <= highest <= {SKINNY_MAX_ROWS}, got {rows!r}")
        if not packed_available():
            raise ValueError("packed linears need oneDNN (torch.backends.mkldnn), which this torch build lacks")
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and rows is not None:
            module.__class__ = SkinnyLinear
            module.skinny_rows = None  # the other row counts stay F.linear's
        if type(module) is SkinnyLinear:
            module.packed_rows = None if rows is None else (int(rows[0]), int(rows[1]))
            module.drop_packed()
            count += 1
    return count


def packed_rows_of(model: nn.Module) -> tuple[int, int] | None:
    """The row counts `model`'s linears take through reordered weights (`use_packed_linears`)."""
    return next((m.packed_rows for m in model.modules() if isinstance(m, SkinnyLinear)), None)


def use_plain_linears(model: nn.Module) -> None:
    """Undo `use_skinny_linears` and `use_packed_linears`: every `SkinnyLinear` in `model` back to
    `nn.Linear` (reordered copies freed), in place."""
    for module in model.modules():
        if type(module) is SkinnyLinear:
            module.drop_packed()
            vars(module).pop("packed_rows", None)
            vars(module).pop("skinny_rows", None)
            module.__class__ = nn.Linear
        elif _takes_skinny_rows(module):
            module.skinny_rows = None


def uses_skinny_linears(model: nn.Module) -> bool:
    """Whether `model`'s linear layers run as skinny linears (the kernel `load_model` kept)."""
    return skinny_rows_of(model) is not None


def skinny_rows_of(model: nn.Module) -> tuple[int, int] | None:
    """The row counts `model`'s skinny linears take (the kernel `load_model` kept); None: plain."""
    return next((m.skinny_rows for m in model.modules() if isinstance(m, SkinnyLinear)), None)


def kernel_picks(model: nn.Module) -> dict[str, list[int] | None]:
    """The row counts `model`'s linears run as skinny linears and through reordered weights (None:
    `F.linear`), as `load_model` picked them: written beside the timings a process makes, since a
    pick can differ between processes and moves every pass the rows cover."""
    skinny, packed = skinny_rows_of(model), packed_rows_of(model)
    return {"skinny_rows": list(skinny) if skinny else None, "packed_rows": list(packed) if packed else None}


def _use_kernel(model: nn.Module, rows: tuple[int, int] | None) -> None:
    if rows is not None:
        use_skinny_linears(model, rows)
    else:
        use_plain_linears(model)


def _time_kernels(
    model: PreTrainedModel, widths: tuple[int, ...], repeats: int, use: Callable[[bool], None]
) -> dict[bool, dict[int, list[float]]]:
    """Seconds of a batch-1 forward of each of `widths` tokens with `use(False)`'s and `use(True)`'s
    kernels, `repeats + 1` rounds (the kernels take turns within each round, so a drifting machine
    biases both alike; the first round warms up and `_faster` drops it)."""
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


def _faster(times: dict[bool, dict[int, list[float]]], chosen: list[int]) -> bool:
    """Whether the `True` kernel beats the `False` one over the `chosen` widths: the median, over the
    rounds after the warm-up, of the ratio of their summed times in the same round, below 1. The
    kernels take turns within a round, so each round's ratio cancels the machine's drift (one
    width's median moved between 92 and 140 ms across timings on the 2-core EPYC)."""
    if not chosen:
        return False
    rounds = range(1, len(times[True][chosen[0]]))
    ratios = [sum(times[True][w][r] for w in chosen) / sum(times[False][w][r] for w in chosen) for r in rounds]
    return statistics.median(ratios) < 1


@torch.inference_mode()
def measure_skinny_rows(model: PreTrainedModel, widths: tuple[int, ...] = AUTO_WIDTHS, repeats: int = 5) -> tuple[int, int] | None:
    """Which row counts skinny linears make faster than `F.linear` in `model`'s passes on this CPU.

    Times a batch-1 forward of each of `widths` tokens with both kernels (`_time_kernels`; the
    one-token pass over `SINGLE_ROW_ROUNDS` times the rounds). A single row and the few rows of a
    verify pass are decided apart (`_faster`), each kernel touching only its own row counts.
    Returns the rows for `use_skinny_linears` (`(1, 64)`, `FEW_ROWS` or `(1, 1)`), None where
    `F.linear` won both. `model` comes back with the kernels it had. 7-9 s for
    SmolLM2-135M on the 2-core EPYC (`outputs/s20/measure_time.py`).
    """
    had = skinny_rows_of(model)

    def use(skinny: bool) -> None:
        _use_kernel(model, (1, SKINNY_MAX_ROWS) if skinny else None)

    wide = tuple(w for w in widths if w > 1)
    single = 1 in widths and _faster(_time_kernels(model, (1,), SINGLE_ROW_ROUNDS * repeats, use), [1])
    few = bool(wide) and _faster(_time_kernels(model, wide, repeats, use), list(wide))
    _use_kernel(model, had)
    if single and few:
        return (1, SKINNY_MAX_ROWS)
    return FEW_ROWS if few else (1, 1) if single else None


@torch.inference_mode()
def measure_packed_rows(model: PreTrainedModel, widths: tuple[int, ...] = PACKED_WIDTHS, repeats: int = 15) -> tuple[int, int] | None:
    """Whether oneDNN's reordered weights make `model`'s verify passes of `widths` tokens faster on
    this CPU than the kernels it has (`_time_kernels`, compared round by round by `_faster`; 15
    rounds: on 5, a process of the 2026-11-26 demo picked them where they ran ~11% slower, which no
    15-round pick did in 8 timings): `PACKED_ROWS` if so, else
    None. `model` comes back with the kernels it had (a float32 model on CPU; anything else, or a
    torch without oneDNN: None, nothing timed). 7-9 s for SmolLM2-135M on the 2-core EPYC."""
    if not packed_available() or model.device.type != "cpu" or model.dtype != torch.float32:
        return None
    had_packed, had_skinny = packed_rows_of(model), skinny_rows_of(model)
    use_packed_linears(model, PACKED_ROWS)
    linears = [m for m in model.modules() if isinstance(m, SkinnyLinear)]

    def use(packed: bool) -> None:  # flips the rows only: the reordered copies stay built
        for module in linears:
            module.packed_rows = PACKED_ROWS if packed else None

    times = _time_kernels(model, widths, repeats, use)
    use_packed_linears(model, had_packed)
    if had_packed is None and had_skinny is None:
        use_plain_linears(model)
    return PACKED_ROWS if _faster(times, list(widths)) else None
