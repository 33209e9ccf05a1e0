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

Which kernel is faster depends on the CPU, so the default is to measure (`skinny_is_faster`, run
by `load_model` when `skinny_matmul` is None). On the 2026-11-23 machine skinny linears brought a
4-token verify from ~1.7x to ~1.1x a step; on the 2026-11-24 one (a 480 MB L3 cache holding most of
SmolLM2's weights, a one-token step of 31 ms instead of 58) they cost 2.0x at every width while
`F.linear` cost 1.03x for 2 rows, 1.07x for 3 and 1.5x for 4 (README, "CPU kernels").
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
# The pass widths the automatic choice times: verify passes of gamma + 1 tokens for gamma 1..4.
AUTO_WIDTHS = (2, 3, 4, 5)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, computed as `(weight @ x.T).T` for 2..SKINNY_MAX_ROWS rows on CPU.

    Args:
        x: `[..., H_in]`.
        weight: `[H_out, H_in]`.
        bias: `[H_out]` or None.

    Returns:
        `[..., H_out]`.
    """
    rows = x.numel() // max(x.shape[-1], 1)
    if (
        x.device.type != "cpu"
        or not 2 <= rows <= SKINNY_MAX_ROWS
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return F.linear(x, weight, bias)
    # MKL's streaming kernel wants the narrow operand as the transpose of row-major rows, and the
    # layers after this one want row-major output (a transposed view would, e.g., give attention
    # queries a last-dim stride != 1 and push SDPA off its flash kernel): both copies are tiny.
    flat = x.reshape(rows, x.shape[-1]).contiguous()
    out = torch.mm(weight, flat.t()).t().contiguous()  # [rows, H_out]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


class SkinnyLinear(nn.Linear):
    """An `nn.Linear` whose forward is `skinny_linear`; same parameters, state dict and checkpoints."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, self.weight, self.bias)


def use_skinny_linears(model: nn.Module) -> int:
    """Switch every plain `nn.Linear` in `model` to `SkinnyLinear`, in place; return how many.

    Only the class changes (no copy, no new parameter), so tied weights stay tied and
    `save_pretrained` writes the same files. Subclasses of `nn.Linear` are left alone: their
    forward may do more than a matmul.
    """
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = SkinnyLinear
            count += 1
    return count


def use_plain_linears(model: nn.Module) -> None:
    """Undo `use_skinny_linears`: every `SkinnyLinear` in `model` back to `nn.Linear`, in place."""
    for module in model.modules():
        if type(module) is SkinnyLinear:
            module.__class__ = nn.Linear


def uses_skinny_linears(model: nn.Module) -> bool:
    """Whether `model`'s linear layers run as skinny linears (the kernel `load_model` kept)."""
    return any(isinstance(m, SkinnyLinear) for m in model.modules())


def _use_kernel(model: nn.Module, skinny: bool) -> None:
    if skinny:
        use_skinny_linears(model)
    else:
        use_plain_linears(model)


@torch.inference_mode()
def skinny_is_faster(model: PreTrainedModel, widths: tuple[int, ...] = AUTO_WIDTHS, repeats: int = 5) -> bool:
    """Whether skinny linears make `model`'s few-token passes faster than `F.linear` on this CPU.

    Times a batch-1 forward of each of `widths` tokens with both kernels (the kernels take turns
    within each repeat, so a drifting machine biases both alike; the first round warms up) and
    compares the summed medians. `model` comes back with the kernels it had. About 2.5 s for
    SmolLM2-135M on a 2-core CPU.
    """
    had_skinny = uses_skinny_linears(model)
    vocab = model.config.get_text_config().vocab_size
    inputs = {w: (torch.arange(w, device=model.device) % vocab).unsqueeze(0) for w in widths}
    times: dict[bool, dict[int, list[float]]] = {kernel: {w: [] for w in widths} for kernel in (False, True)}
    for _ in range(repeats + 1):
        for skinny in (False, True):
            _use_kernel(model, skinny)
            for width, ids in inputs.items():
                start = time.perf_counter()
                model(input_ids=ids)
                times[skinny][width].append(time.perf_counter() - start)
    _use_kernel(model, had_skinny)
    total = {kernel: sum(statistics.median(t[1:]) for t in by_width.values()) for kernel, by_width in times.items()}
    return total[True] < total[False]
