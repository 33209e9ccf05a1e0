"""The one `device` / `dtype` knob every app reads (top level of each conf/*.yaml), checked once.

`check_device_name` is a pure string check, run when a config is built (a typo fails before any
work); `resolve_device` checks the machine at the start of a run: `cuda:N` must exist, and it is
made the current CUDA device so that everything placed on plain `"cuda"` (accelerate's device,
the embedder, caches) lands on the same GPU.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

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
    return dtype  # type: ignore[return-value]


def resolve_device(device: str) -> torch.device:
    """The torch device for a checked `device` string, after checking this machine has it.

    Raises:
        ValueError: naming the device when it is malformed or this machine lacks it.
    """
    resolved = torch.device(check_device_name(device))
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = 0 if resolved.index is None else resolved.index
        if index >= count:
            raise ValueError(f"device={device!r}: this machine has {count} CUDA device(s)")
        # accelerate and code that says plain "cuda" use the current device: make it this one.
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={device!r}: MPS is not available on this machine")
    return resolved


def placed_accelerator(device: str, **kwargs: object) -> tuple[Accelerator, torch.device]:
    """An `Accelerator` on `device`, and the device this process should put its models on.

    A single process honours `device` exactly (`cuda:1` included). Under `accelerate launch`
    with several processes, each process takes the device accelerate assigned it (one per local
    rank), of the kind `device` names.
    """
    from accelerate import Accelerator

    resolved = resolve_device(device)
    accelerator = Accelerator(cpu=resolved.type == "cpu", **kwargs)  # type: ignore[arg-type]
    if accelerator.num_processes > 1:
        return accelerator, accelerator.device
    return accelerator, resolved
