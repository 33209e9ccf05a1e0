"""Linear layers that stay memory-bound for a few rows on CPU: what makes a verify pass cheap.

A decode step multiplies one row per sequence by every weight matrix, so on a CPU it costs one
sweep of the weights through memory. A verify pass multiplies gamma + 1 rows, and should cost about
the same sweep. With `F.linear` it may not: for 2..16 rows MKL can leave its matrix-vector kernel
for a blocked GEMM that packs the weights first, and a few-row pass then costs up to 2-3x a 1-row
pass. Computing the same product as `weight @ x.T` (the weights as the left operand, the few rows as
the narrow right one) keeps MKL on a streaming kernel there.

The numbers are the same products summed by another kernel: results agree with `F.linear` to
float rounding, not bitwise, just as MKL's own 1-row and many-row kernels do not agree bitwise.
Training (inputs that need grad) and GPU tensors take the ordinary path.

A single row (every decode step of the target alone, every drafting step) is the other case: on
some CPUs MKL runs a matrix-vector product on one core only, so a 1-row pass takes longer than a
2-row one. Computed as two identical rows through the same `weight @ x.T`, it is a product MKL
splits across the cores; the copy of one row costs nothing.

Which kernel is faster depends on the CPU, so `load_model` (`skinny_matmul=None`) picks by
measurement, once per machine and kept on disk (`kernel_choice.py`): the single row and the few
rows are decided apart, since each kernel choice only touches its own row counts. On some CPUs
skinny linears are the slow kernel at every width.

Past two rows MKL's `weight @ x.T` can leave its streaming kernel too, making a verify of gamma >= 2
drafts cost more than a step. oneDNN's inner product over weights reordered once into its blocked
layout (`use_packed_linears`) streams them for 3..16 rows. The reordered copy costs the weights' memory
again, kept beside them (a single row and two rows stay faster on the plain weights), so it is only
used where
`kernel_choice.measure_packed_rows` timed it faster, on float32 CPU weights, and never for inputs
that need grad. Its two ops are private to torch (`torch.ops.mkldnn._reorder_linear_weight`,
`_linear_pointwise`): where they are missing or fail, nothing is packed (`packed_available`), and a
layer whose op fails at a call takes its plain kernel from then on. The same CPU can time it
faster or slower than skinny linears from one run to the next: the measurement decides, not the
CPU's name. It is rebuilt whenever the weights change (training steps, `load_state_dict`), by their version.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# Above this many rows (e.g. a prefill, a training batch) the blocked GEMM is the faster kernel.
SKINNY_MAX_ROWS = 64
# The row counts a skinny linear takes, (lowest, highest): a verify pass's few rows, as `True` forces.
FEW_ROWS = (2, SKINNY_MAX_ROWS)
# The row counts oneDNN's reordered weights take where measured faster: verify passes of gamma 2..4
# at batch 1 (3..5 rows) up to batched ones; above, a prefill's many rows take the blocked GEMM.
PACKED_ROWS = (3, 16)


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


def mkldnn_op(name: str) -> Callable[..., torch.Tensor] | None:
    """`torch.ops.mkldnn.<name>`, a private op of torch's CPU builds, or None where this build lacks it."""
    try:
        return getattr(torch.ops.mkldnn, name)
    except (AttributeError, RuntimeError):
        return None


def packed_available() -> bool:
    """Whether this torch build has oneDNN's reordered-weight inner product (x86 CPU wheels do) and
    it computes `F.linear`'s product: its private ops, tried on a tiny product."""
    reorder, linear = mkldnn_op("_reorder_linear_weight"), mkldnn_op("_linear_pointwise")
    if not torch.backends.mkldnn.is_available() or reorder is None or linear is None:
        return False
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(8, 16, generator=generator), torch.randn(3, 16, generator=generator)
    try:
        with torch.inference_mode():
            out = linear(x, reorder(weight, PACKED_ROWS[0]), None, "none", [], "")
        return torch.allclose(out, x @ weight.t(), rtol=1e-4, atol=1e-4)
    except (RuntimeError, TypeError, ValueError):
        return False


class SkinnyLinear(nn.Linear):
    """An `nn.Linear` whose forward is `skinny_linear` over its `skinny_rows` (None: `F.linear`),
    and oneDNN's product over reordered weights for its `packed_rows` (None: never); same
    parameters, state dict and checkpoints."""

    skinny_rows: tuple[int, int] | None = FEW_ROWS
    packed_rows: tuple[int, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._takes_packed(x):
            out = self._packed_forward(x)
            if out is not None:
                return out
        if self.skinny_rows is None:
            return F.linear(x, self.weight, self.bias)
        return skinny_linear(x, self.weight, self.bias, self.skinny_rows)

    def _takes_packed(self, x: torch.Tensor) -> bool:
        count = x.numel() // max(x.shape[-1], 1)
        rows = self.packed_rows
        return (
            rows is not None
            and rows[0] <= count <= rows[1]
            and x.device.type == "cpu"
            and x.dtype == self.weight.dtype == torch.float32
            # no_grad / inference_mode only: oneDNN's op has no backward, and its reordered copy,
            # built under inference_mode, must not reach an autograd graph
            and not torch.is_grad_enabled()
        )

    def _packed_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """`F.linear` over `[..., H_in]` → `[..., H_out]` through the reordered weights, reordered
        again first if the weights changed since (an optimizer step or a load bumps their version;
        `.to()` moves their storage). None where torch's private oneDNN ops are missing or fail:
        this layer then takes its plain kernel from now on, with a warning."""
        reorder, linear = mkldnn_op("_reorder_linear_weight"), mkldnn_op("_linear_pointwise")
        try:
            if reorder is None or linear is None:
                raise RuntimeError("torch.ops.mkldnn._reorder_linear_weight / _linear_pointwise are missing")
            key = (self.weight._version, self.weight.data_ptr())
            cached = self.__dict__.get("_packed")
            if cached is None or cached[0] != key:
                # The batch-size hint picks oneDNN's layout: any hint above 1 measured alike for
                # 3..16 rows; hint 1 took 1.5-2x longer for them.
                with torch.no_grad():
                    cached = (key, reorder(self.weight.detach(), PACKED_ROWS[0]))
                self.__dict__["_packed"] = cached
            out = linear(x.reshape(-1, x.shape[-1]), cached[1], self.bias, "none", [], "")
        except (RuntimeError, TypeError, ValueError) as error:
            warnings.warn(
                f"packed linears off, plain kernels instead: oneDNN's packed product failed ({error})", stacklevel=3
            )
            self.packed_rows = None
            self.drop_packed()
            return None
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
        raise ValueError(
            f"skinny rows must be (lowest, highest) with 1 <= lowest <= highest <= {SKINNY_MAX_ROWS}, got {rows!r}"
        )
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
            raise ValueError(
                f"packed rows must be (lowest, highest) with 1 <= lowest <= highest <= {SKINNY_MAX_ROWS}, got {rows!r}"
            )
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


def skinny_rows_of(model: nn.Module) -> tuple[int, int] | None:
    """The row counts `model`'s skinny linears take (the kernel `load_model` kept); None: plain."""
    return next((m.skinny_rows for m in model.modules() if isinstance(m, SkinnyLinear)), None)


def kernel_picks(model: nn.Module) -> dict[str, list[int] | None]:
    """The row counts `model`'s linears run as skinny linears and through reordered weights (None:
    `F.linear`), as `load_model` picked them: written beside the timings a process makes, since a
    pick can differ between processes and moves every pass the rows cover."""
    skinny, packed = skinny_rows_of(model), packed_rows_of(model)
    return {"skinny_rows": list(skinny) if skinny else None, "packed_rows": list(packed) if packed else None}
