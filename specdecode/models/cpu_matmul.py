"""Linear layers that stay memory-bound for a few rows on CPU: what makes a verify pass cheap.

A decode step multiplies one row per sequence by every weight matrix, so on a CPU it costs one
sweep of the weights through memory. A verify pass multiplies gamma + 1 rows, and should cost about
the same sweep. With `F.linear` it does not: for 2..16 rows MKL leaves its matrix-vector kernel for
a blocked GEMM that packs the weights first, and on the 2-core development machine a 2..9-row pass
over SmolLM2-135M's weights took 1.6-2.7x a 1-row pass (README, "Measured with and without skinny
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
EPYC) that took SmolLM2-135M's one-token step from 60 to 38 ms (README, "One row as two").

Which kernel is faster depends on the CPU, so the default is to measure (`measure_skinny_rows`, run
by `load_model` when `skinny_matmul` is None): the single row and the few rows are decided apart,
since each kernel choice only touches its own row counts. On the 2026-11-23 machine skinny linears
brought a 4-token verify from ~1.7x to ~1.1x a step; on the 2026-11-24 one (a 480 MB L3 cache
holding most of SmolLM2's weights, a one-token step of 31 ms instead of 58) they cost 2.0x at every
width while `F.linear` cost 1.03x for 2 rows, 1.07x for 3 and 1.5x for 4 (README, "CPU kernels").
"""

from __future__ import annotations

import statistics
import time

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


class SkinnyLinear(nn.Linear):
    """An `nn.Linear` whose forward is `skinny_linear` over its `skinny_rows`; same parameters,
    state dict and checkpoints."""

    skinny_rows: tuple[int, int] = FEW_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, self.weight, self.bias, self.skinny_rows)


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


def use_plain_linears(model: nn.Module) -> None:
    """Undo `use_skinny_linears`: every `SkinnyLinear` in `model` back to `nn.Linear`, in place."""
    for module in model.modules():
        if type(module) is SkinnyLinear:
            module.__class__ = nn.Linear
        elif _takes_skinny_rows(module):
            module.skinny_rows = None


def uses_skinny_linears(model: nn.Module) -> bool:
    """Whether `model`'s linear layers run as skinny linears (the kernel `load_model` kept)."""
    return skinny_rows_of(model) is not None


def skinny_rows_of(model: nn.Module) -> tuple[int, int] | None:
    """The row counts `model`'s skinny linears take (the kernel `load_model` kept); None: plain."""
    return next((m.skinny_rows for m in model.modules() if isinstance(m, SkinnyLinear)), None)


def _use_kernel(model: nn.Module, rows: tuple[int, int] | None) -> None:
    if rows is not None:
        use_skinny_linears(model, rows)
    else:
        use_plain_linears(model)


@torch.inference_mode()
def measure_skinny_rows(model: PreTrainedModel, widths: tuple[int, ...] = AUTO_WIDTHS, repeats: int = 5) -> tuple[int, int] | None:
    """Which row counts skinny linears make faster than `F.linear` in `model`'s passes on this CPU.

    Times a batch-1 forward of each of `widths` tokens with both kernels (the kernels take turns
    within each repeat, so a drifting machine biases both alike; the first round warms up). A single
    row and the few rows of a verify pass are decided apart, each kernel touching only its own row
    counts: the one-token median for the first, the summed medians of the wider passes for the
    second. Returns the rows for `use_skinny_linears` (`(1, 64)`, `FEW_ROWS` or `(1, 1)`), None
    where `F.linear` won both. `model` comes back with the kernels it had. About 3 s for
    SmolLM2-135M on a 2-core CPU.
    """
    had = skinny_rows_of(model)
    vocab = model.config.get_text_config().vocab_size
    inputs = {w: (torch.arange(w, device=model.device) % vocab).unsqueeze(0) for w in widths}
    times: dict[bool, dict[int, list[float]]] = {kernel: {w: [] for w in widths} for kernel in (False, True)}
    for _ in range(repeats + 1):
        for skinny in (False, True):
            _use_kernel(model, (1, SKINNY_MAX_ROWS) if skinny else None)
            for width, ids in inputs.items():
                start = time.perf_counter()
                model(input_ids=ids)
                times[skinny][width].append(time.perf_counter() - start)
    _use_kernel(model, had)

    def faster(chosen: list[int]) -> bool:
        total = {kernel: sum(statistics.median(by_width[w][1:]) for w in chosen) for kernel, by_width in times.items()}
        return bool(chosen) and total[True] < total[False]

    single, few = faster([w for w in widths if w == 1]), faster([w for w in widths if w > 1])
    if single and few:
        return (1, SKINNY_MAX_ROWS)
    return FEW_ROWS if few else (1, 1) if single else None
