"""The lowest layer: atomic writes, output locks, device / dtype, config helpers. Imports nothing else of specdecode."""

from specdecode.core.atomic import publish_files, write_atomic
from specdecode.core.config import MAX_GAMMA, Placement, from_dict, is_int, is_number, require
from specdecode.core.devices import check_device_name, check_dtype_name, placed_accelerator, resolve_device
from specdecode.core.locking import OutputInUseError, check_writable, locks_output_dir, output_lock

__all__ = [
    "MAX_GAMMA",
    "OutputInUseError",
    "Placement",
    "check_device_name",
    "check_dtype_name",
    "check_writable",
    "from_dict",
    "is_int",
    "is_number",
    "locks_output_dir",
    "output_lock",
    "placed_accelerator",
    "publish_files",
    "require",
    "resolve_device",
    "write_atomic",
]
