"""Linear layers that stay memory-bound for a few rows on CPU, so a verify pass of gamma + 1 rows
costs about one decode step: `F.linear` may switch MKL to a blocked GEMM for 2..16 rows (up to
2-3x a 1-row pass); `weight @ x.T` keeps it streaming (a single row, which MKL may run on one core,
goes as two identical rows). Equal to `F.linear` to float rounding. Opt-in:
`load_model(skinny_matmul=True)` forces it for 2..64 rows, `None` times both once per machine
(`kernel_choice.py`), `False` (default) is off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Above this many rows (e.g. a prefill, a training batch) the blocked GEMM is the faster kernel.
SKINNY_MAX_ROWS = 64
# The row counts a skinny linear takes, (lowest, highest): a verify pass's few rows, as `True` forces.
FEW_ROWS = (2, SKINNY_MAX_ROWS)


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, rows: tuple[int, int] = FEW_ROWS
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` `[..., H_in]` → `[..., H_out]`, computed as `(weight @ x.T).T`
    on CPU when `x` has `rows[0]..rows[1]` rows (inclusive); a single row goes through as two."""
    count = x.numel() // max(x.shape[-1], 1)
    if (
        x.device.type != "cpu"
        or not rows[0] <= count <= min(rows[1], SKINNY_MAX_ROWS)
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return F.linear(x, weight, bias)
    # MKL streams the transpose of row-major rows; the next layers want row-major output (a
    # transposed view would push SDPA off its flash kernel): both copies are tiny.
    flat = x.reshape(count, x.shape[-1]).contiguous()
    if count == 1:
        # one column would be a matrix-vector product, which MKL may run on one core
        out = torch.mm(weight, flat.expand(2, -1).contiguous().t())[:, :1].t().contiguous()
    else:
        out = torch.mm(weight, flat.t()).t().contiguous()  # [rows, H_out]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


class SkinnyLinear(nn.Linear):
    """An `nn.Linear` whose forward is `skinny_linear` over its `skinny_rows` (None: `F.linear`);
    same parameters, state dict and checkpoints."""

    skinny_rows: tuple[int, int] | None = FEW_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.skinny_rows is None:
            return F.linear(x, self.weight, self.bias)
        return skinny_linear(x, self.weight, self.bias, self.skinny_rows)


def use_skinny_linears(model: nn.Module, rows: tuple[int, int] = FEW_ROWS) -> int:
    """Switch every plain `nn.Linear` in `model` to a `SkinnyLinear` over `rows` row counts, in place
    (only the class changes: tied weights stay tied, checkpoints the same); return how many.
    Subclasses of `nn.Linear` are left alone: their forward may do more than a matmul."""
    if not (len(rows) == 2 and 1 <= rows[0] <= rows[1] <= SKINNY_MAX_ROWS):
        raise ValueError(
            f"skinny rows must be (lowest, highest) with 1 <= lowest <= highest <= {SKINNY_MAX_ROWS}, got {rows!r}"
        )
    count = 0
    for module in model.modules():
        if type(module) in (nn.Linear, SkinnyLinear):
            module.__class__ = SkinnyLinear
            setattr(module, "skinny_rows", (int(rows[0]), int(rows[1])))
            count += 1
        elif _takes_skinny_rows(module):
            setattr(module, "skinny_rows", (int(rows[0]), int(rows[1])))
    return count


def _takes_skinny_rows(module: nn.Module) -> bool:
    """A module that is no `nn.Linear` but runs its product through `skinny_linear`, e.g. a `DraftVocabHead`."""
    return not isinstance(module, nn.Linear) and "skinny_rows" in vars(type(module))


def use_plain_linears(model: nn.Module) -> None:
    """Undo `use_skinny_linears`: every `SkinnyLinear` in `model` back to `nn.Linear`, in place."""
    for module in model.modules():
        if type(module) is SkinnyLinear:
            vars(module).pop("skinny_rows", None)
            setattr(module, "__class__", nn.Linear)
        elif _takes_skinny_rows(module):
            setattr(module, "skinny_rows", None)


def skinny_rows_of(model: nn.Module) -> tuple[int, int] | None:
    """The row counts `model`'s skinny linears take (the kernel `load_model` kept); None: plain."""
    return next((m.skinny_rows for m in model.modules() if isinstance(m, SkinnyLinear)), None)


def kernel_picks(model: nn.Module) -> dict[str, list[int] | None]:
    """The row counts `model`'s linears run as skinny linears (None: `F.linear`), written beside
    the timings a process makes (a measured pick can differ between processes)."""
    skinny = skinny_rows_of(model)
    return {"skinny_rows": list(skinny) if skinny else None}
