"""Config helpers every stage's schema uses: `from_dict`, `require`, the app-wide `Placement`, the
gamma bound. Each stage's dataclass configs validate themselves in `__post_init__`, naming the bad field."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeGuard, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from specdecode.core.devices import check_device_name, check_dtype_name

T = TypeVar("T")

# Largest gamma any entry point accepts: acceptance decays geometrically along a draft, and each row
# reserves gamma + 1 KV slots, so a typo like gamma=100000 must fail.
MAX_GAMMA = 64
GAMMA_RANGE = f"an int in [1, {MAX_GAMMA}]"
# Smallest temperature above 0 (greedy): logits divided by far less overflow fp32 to inf and the softmax to NaN.
MIN_TEMPERATURE = 1e-4
TEMPERATURE_RANGE = f"a finite number >= {MIN_TEMPERATURE:g}, or 0 (greedy)"


def from_dict(cls: type[T], data: dict[str, Any] | DictConfig, where: str = "") -> T:
    """Build dataclass `cls` from a (Hydra-composed) dict, the dataclass as OmegaConf's schema: values are
    converted to the field's type, and an unknown key or a wrong type raises a one-line ValueError
    `<where><dotted key>: <what is wrong>` (`gama: Key 'gama' not in 'BenchmarkConfig'; known: [...]`)."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), data))  # type: ignore[return-value]  # to_object of a structured cls builds a cls
    except OmegaConfBaseException as error:
        message = str(getattr(error, "msg", None) or error).splitlines()[0]
        key = f"{where}{error.full_key}" if getattr(error, "full_key", None) else where.rstrip(".") or "config"
        owner = getattr(error, "object_type", None)
        known = (
            f"; known: {sorted(f.name for f in fields(owner))}"
            if isinstance(error, ConfigKeyError) and dataclasses.is_dataclass(owner)
            else ""
        )
        raise ValueError(f"{key}: {message}{known}") from None


def config_differences(
    a: Mapping[str, Any], b: Mapping[str, Any], ignore: Collection[str], in_a: str, in_b: str
) -> list[str]:
    """`key: <a's value> <in_a>, <b's value> <in_b>` for every dotted key outside `ignore` whose
    value differs between the nested configs `a` and `b` (`<absent>` where one lacks the key)."""
    flat_a, flat_b, absent = _dotted(a), _dotted(b), "<absent>"
    return [
        f"{key}: {flat_a.get(key, absent)!r} {in_a}, {flat_b.get(key, absent)!r} {in_b}"
        for key in sorted(flat_a.keys() | flat_b.keys())
        if key not in ignore and flat_a.get(key, absent) != flat_b.get(key, absent)
    ]


def _dotted(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat |= _dotted(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def require(condition: bool, name: str, value: object, expectation: str) -> None:
    """Raise `ValueError("name=value: expectation")` unless `condition` holds."""
    if not condition:
        raise ValueError(f"{name}={value!r}: {expectation}")


def require_choice(name: str, value: object, choices: Sequence[str]) -> None:
    """`value` is one of `choices`; else a ValueError naming it and listing them (`a|b|c`)."""
    require(value in choices, name, value, "|".join(choices))


def require_int(
    name: str, value: object, low: int, high: int | None = None, nullable: bool = False, note: str = ""
) -> None:
    """`value` is an int in [low, high] (high None: >= low), or None where `nullable`; else a ValueError."""
    ok = (nullable and value is None) or (is_int(value) and low <= value and (high is None or value <= high))
    span = f">= {low}" if high is None else f"in [{low}, {high}]"
    require(ok, name, value, f"{'null or ' if nullable else ''}an int {span}{note}")


def require_finite(name: str, value: object, low: float, strict: bool = False, note: str = "") -> None:
    """`value` is a finite number >= low (> low where `strict`); else a ValueError ending with `note`."""
    ok = is_number(value) and math.isfinite(value) and (value > low if strict else value >= low)
    require(ok, name, value, f"a finite number {'>' if strict else '>='} {low:g}{note}")


def require_ints(owner: object, names: str, minimum: int = 1, *, nullable: bool = False, prefix: str = "") -> None:
    """Each of `owner`'s space-separated fields `names` is an int >= `minimum` (or null where `nullable`)."""
    for name in names.split():
        require_int(prefix + name, getattr(owner, name), minimum, nullable=nullable)


def is_int(value: object) -> TypeGuard[int]:
    """An int that is not a bool (YAML's `true` must not pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_gamma(value: object) -> bool:
    """A draft length every entry point accepts: an int in [1, MAX_GAMMA] (`GAMMA_RANGE`)."""
    return is_int(value) and 1 <= value <= MAX_GAMMA


def is_number(value: object) -> TypeGuard[int | float]:
    """An int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_temperature(value: object) -> bool:
    """A sampling temperature every entry point accepts (`TEMPERATURE_RANGE`; NaN fails both comparisons)."""
    return is_number(value) and (value == 0 or MIN_TEMPERATURE <= value < float("inf"))


@dataclass
class Placement:
    """The one `device` / `dtype` of an app; apps subclass this and call `check_placement()`."""

    device: str = "cpu"
    dtype: str = "float32"
    # CPU linears over 2..64 rows as `weight @ x.T` (models.cpu_matmul); null: the faster, timed once per machine.
    skinny_matmul: bool | None = False
    # The static core under torch.compile (decoding.compiled); null: on for CUDA, on the CPU where measured faster.
    compile: bool | None = None

    def check_placement(self) -> None:
        self.device = check_device_name(self.device)
        self.dtype = check_dtype_name(self.dtype)
        for name, null in (
            ("skinny_matmul", "the faster kernel, measured once per machine"),
            ("compile", "on for CUDA; on the CPU as measured faster"),
        ):
            value = getattr(self, name)
            require(value is None or isinstance(value, bool), name, value, f"true, false or null ({null})")
