"""Local data files (.jsonl, .jsonl.gz, .json, .csv, .parquet) read into a `datasets.Dataset`, and
the files pip packages ship (`package_path`). Each read builds its Arrow table in a temporary
folder and keeps the result in memory: no cache left behind, no stale table after an edit, no hub.
"""

from __future__ import annotations

import contextlib
import csv
import glob
import gzip
import importlib.util
import json
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets

FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".csv", ".parquet")


def read_data_file(path: Path) -> datasets.Dataset:
    """Read a local data file by its suffix (.json: an array of objects). A ValueError for an
    unsupported suffix or an unparsable file (for JSON lines, naming the line); FileNotFoundError."""
    suffix = file_suffix(path)
    if suffix not in FILE_SUFFIXES:
        raise ValueError(f"unsupported file type {suffix!r} of {str(path)!r}; supported: {', '.join(FILE_SUFFIXES)}")
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {str(path)!r}")
    if path.stat().st_size == 0:
        raise ValueError(f"data file {str(path)!r} is empty")
    if suffix != ".parquet":
        check_utf8(path)
    if suffix in (".jsonl", ".jsonl.gz"):
        return read_jsonl(path)
    if suffix == ".json":
        return _load("json", path, "JSON (an array of objects)")
    if suffix == ".csv":
        return _read_csv(path)
    return _load("parquet", path, "Parquet")


def check_utf8(path: Path) -> None:
    """A ValueError naming the first line of a text data file that is not UTF-8 (pyarrow would fail
    later, where a row is used, with a bare UnicodeDecodeError)."""
    opener = gzip.open if path.suffix.lower() == ".gz" else open
    with opener(path, "rb") as handle:
        for line_number, line in enumerate(handle, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"{str(path)!r} line {line_number} is not UTF-8 text ({error}); save the file as UTF-8"
                ) from None


def file_suffix(path: Path) -> str:
    """The suffix that names a data file's format: `.jsonl.gz` for gzipped JSON lines, else the last one."""
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    return ".jsonl.gz" if suffixes == [".jsonl", ".gz"] else path.suffix.lower()


def package_path(package: str, relative: str, pip_name: str, needed_by: str, install: str | None = None) -> Path:
    """`relative` inside the installed `package`, located without importing its code. ImportError
    where it is missing, saying that `needed_by` needs it and how to install it; FileNotFoundError."""
    install = install or f"pip install {pip_name}"
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{needed_by} needs the `{pip_name}` package: {install}")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.exists():
        raise FileNotFoundError(f"{pip_name} is installed but has no {relative!r} (looked at {str(path)!r}): {install}")
    return path


def read_jsonl(path: Path) -> datasets.Dataset:
    """Read a JSON-lines file (`.gz` decompressed); on failure, a ValueError naming the bad line."""
    try:
        return _load("json", path, "JSON lines")
    except ValueError as error:
        try:  # name the bad line (datasets raises a bare StopIteration for a file of blank lines)
            sum(1 for _ in json_objects(path))
        except ValueError as problem:
            raise problem from error
        raise


def _read_csv(path: Path) -> datasets.Dataset:
    # Every column as the text written: pandas would turn "007" into 7 and read "NA" as missing.
    with path.open(newline="", encoding="utf-8-sig") as handle:
        header = next(csv.reader(handle), [])
    features = datasets.Features({name: datasets.Value("string") for name in header})
    return _load("csv", path, "CSV", features=features, keep_default_na=False)


def _load(builder: str, path: Path, what: str, **config: Any) -> datasets.Dataset:
    """`datasets.load_dataset(builder, data_files=path)`: a temporary cache, in memory, local files only;
    a ValueError naming the file and `what` it should be where the builder fails."""
    try:
        with tempfile.TemporaryDirectory(prefix="specdecode-datasets-") as cache, _quiet_datasets():
            dataset = datasets.load_dataset(
                builder,
                # data_files are glob patterns: escaped, a name such as "chat [v2].jsonl" is itself.
                data_files=glob.escape(str(path.resolve())),
                split="train",
                cache_dir=cache,
                keep_in_memory=True,
                download_config=datasets.DownloadConfig(local_files_only=True),
                **config,
            )
    except Exception as error:
        raise ValueError(f"could not read {str(path)!r} as {what}: {error}") from error
    assert isinstance(dataset, datasets.Dataset)
    return dataset


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Silence datasets' progress bars and logging (it logs a parse error we raise better) for one read."""
    bars_were_disabled = datasets.utils.are_progress_bars_disabled()
    verbosity = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if not bars_were_disabled:
            datasets.enable_progress_bars()


def json_objects(path: Path, name: str = "") -> Iterator[dict[str, Any]]:
    """The objects of a JSON-lines file (`.gz` decompressed), blank lines skipped, read lazily; a ValueError
    names the file (after `name`) and its first line that is not a JSON object, or that all are blank."""
    opener = gzip.open if path.suffix.lower() == ".gz" else open
    where = f"{name}{str(path)!r}"
    rows = 0
    with opener(path, "rt", encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where} line {line_number} is not JSON: {error}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where} line {line_number} is not a JSON object")
            rows += 1
            yield row
    if not rows:
        raise ValueError(f"{where} holds no JSON object: every line is blank")
