"""The one `device` / `dtype` knob every app reads: `check_device_name` checks the string when a
config is built, `resolve_device` the machine when a run starts."""

from __future__ import annotations

import re
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator

DTYPES = ("float32", "bfloat16", "float16")
_DEVICE = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")


def check_device_name(device: object, name: str = "device") -> str:
    """`device` if it is `cpu`, `mps`, `cuda` or `cuda:N`; else a ValueError naming it."""
    if not isinstance(device, str) or not _DEVICE.match(device.strip()):
        raise ValueError(f"{name}={device!r}: expected cpu, cuda, cuda:N or mps")
    return device.strip()


def check_dtype_name(dtype: object, name: str = "dtype") -> str:
    if dtype not in DTYPES:
        raise ValueError(f"{name}={dtype!r}: expected {'|'.join(DTYPES)}")
    return str(dtype)


def resolve_device(device: str) -> torch.device:
    """The torch device for `device`; a ValueError naming it where it is malformed or this machine
    lacks it. A CUDA device is made current, so that plain `"cuda"` lands on it too."""
    resolved = torch.device(check_device_name(device))
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = 0 if resolved.index is None else resolved.index
        if index >= count:
            raise ValueError(f"device={device!r}: this machine has {count} CUDA device(s)")
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={device!r}: MPS is not available on this machine")
    return resolved


MIXED_PRECISIONS = ("auto", "no", "bf16", "fp16")


def fast_bf16(device: torch.device) -> bool:
    """Whether `device` computes bfloat16 matmuls natively: a CUDA GPU that supports bf16, or a
    CPU with AMX-BF16 or AVX512-BF16 (elsewhere bf16 is converted to fp32 around every matmul)."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        capabilities: dict[str, Any] = getattr(torch.cpu, "get_capabilities", dict)()
        return bool(capabilities.get("amx_bf16", False) or capabilities.get("avx512_bf16", False))
    return False


def resolve_mixed_precision(setting: str, device: torch.device) -> str:
    """A training job's `mixed_precision` made definite: `auto` is `bf16` where `fast_bf16`, else `no`.
    The jobs autocast themselves: accelerate's `mixed_precision` is process-wide, fixed by the first
    `Accelerator`, so an in-process pipeline could not train in bf16 and then evaluate in fp32."""
    if setting not in MIXED_PRECISIONS:
        raise ValueError(f"mixed_precision={setting!r}: expected {'|'.join(MIXED_PRECISIONS)}")
    if setting != "auto":
        return setting
    return "bf16" if fast_bf16(device) else "no"


def autocast_dtype(mixed_precision: str) -> torch.dtype | None:
    """The autocast dtype of a resolved `mixed_precision` (None: `no`, run in the models' dtype)."""
    return {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mixed_precision]


def autocast_context(device: torch.device, dtype: torch.dtype | None) -> AbstractContextManager[object]:
    """`torch.autocast` on `device`'s kind at `dtype`, or nothing when `dtype` is None."""
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def placed_accelerator(device: str, **kwargs: object) -> tuple[Accelerator, torch.device]:
    """An `Accelerator` on `device`, and the device this process puts its models on."""
    from accelerate import Accelerator

    resolved = resolve_device(device)
    accelerator = Accelerator(cpu=resolved.type == "cpu", **kwargs)
    if accelerator.num_processes > 1:
        return accelerator, accelerator.device
    return accelerator, resolved
