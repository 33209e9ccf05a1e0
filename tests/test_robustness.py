"""Cross-cutting guarantees: published files are readable, output folders have one writer, and
a folder that cannot be written is reported before any work."""

from __future__ import annotations

import multiprocessing
import os
import socket
import stat
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from specdecode.core.atomic import write_atomic
from specdecode.core.config import from_dict
from specdecode.core.locking import LOCK_FILE, OutputInUseError, acquire, output_lock
from specdecode.evaluation.benchmark import run_benchmark
from specdecode.evaluation.config import BenchmarkConfig, EvalConfig
from specdecode.evaluation.suite import run_eval
from specdecode.models.config import TargetConfig
from specdecode.pipeline.config import DemoConfig
from specdecode.pipeline.demo import run_demo
from specdecode.routing.collect import run_collect
from specdecode.routing.config import CollectConfig, FitRouterConfig
from specdecode.routing.fit import run_fit
from specdecode.training.job import run_distill
from specdecode.training.sequences import TrainSequence
from specdecode.training.teacher import TeacherCache, load_cache, save_cache
from tests.test_train import smoke_cfg


@pytest.fixture
def umask() -> Iterator[None]:
    """Let a test set the umask; the previous one comes back afterwards."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("mask, expected", [(0o022, 0o644), (0o027, 0o640)])
def test_published_files_get_the_umask_mode(tmp_path: Path, umask: None, mask: int, expected: int) -> None:
    os.umask(mask)
    write_atomic(tmp_path / "results.json", "{}")
    write_atomic(tmp_path / "weights.bin", b"\0\1")
    cache = TeacherCache(
        [TrainSequence([1, 2, 3], 1)], torch.tensor([0, 2]), torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4)
    )
    save_cache(cache, tmp_path / "cache.pt")
    assert {p.name: _mode(p) for p in tmp_path.iterdir()} == dict.fromkeys(
        ["results.json", "weights.bin", "cache.pt"], expected
    )
    assert load_cache(tmp_path / "cache.pt").sequences == cache.sequences


def test_training_outputs_are_readable_under_umask_022(tmp_path: Path, umask: None) -> None:
    run_distill(smoke_cfg(tmp_path, "train.max_steps=1"))
    published = [p for p in (tmp_path / "out").rglob("*") if p.is_file()] + [
        p for p in (tmp_path / "cache").rglob("*") if p.is_file()
    ]
    assert {p.name for p in published} >= {"metrics.json", "config.yaml", "metrics.jsonl", "config.json"}
    assert {str(p.relative_to(tmp_path)): _mode(p) for p in published if _mode(p) != 0o644} == {}


# --- one writer per output folder ------------------------------------------------------------------


@pytest.fixture
def live_lock(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """`(folder, pid)`: a folder locked by another live process (a `sleep` this test starts)."""
    sleeper = subprocess.Popen(["sleep", "60"])
    folder = tmp_path / "busy"
    folder.mkdir()
    (folder / LOCK_FILE).write_text(f"{socket.gethostname()} {sleeper.pid}\n")
    try:
        yield folder, sleeper.pid
    finally:
        sleeper.kill()
        sleeper.wait()


def _eval_cfg(output_dir: Path, target: str = "smoke") -> EvalConfig:
    return EvalConfig(
        target=TargetConfig(name=target), methods=["autoregressive"], synthetic=True, output_dir=str(output_dir)
    )


def test_second_writer_is_told_the_pid_in_use(tmp_path: Path, live_lock: tuple[Path, int]) -> None:
    folder, pid = live_lock
    needle = rf"output_dir='{folder}' is in use by PID {pid}"
    with pytest.raises(OutputInUseError, match=needle):
        run_distill(smoke_cfg(tmp_path, f"output_dir={folder}"))
    with pytest.raises(OutputInUseError, match=needle):
        run_eval(_eval_cfg(folder))
    with pytest.raises(OutputInUseError, match=needle):
        run_demo(DemoConfig(output_dir=str(folder)))
    assert sorted(p.name for p in folder.iterdir()) == [LOCK_FILE]  # nothing was written


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / LOCK_FILE).write_text(f"{socket.gethostname()} {dead.pid}\n")
    with pytest.warns(UserWarning, match=f"stale lock .*{dead.pid}"), output_lock(tmp_path) as lock:
        assert lock.read_text().split() == [socket.gethostname(), str(os.getpid())]
    assert not lock.exists()


def test_lock_is_released_when_the_job_fails(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"), output_lock(tmp_path):
        raise RuntimeError("boom")
    assert not (tmp_path / LOCK_FILE).exists()
    with pytest.raises(ValueError, match="train.teacher_topk"):
        run_distill(smoke_cfg(tmp_path, "train.teacher_topk=100000"))
    assert not (tmp_path / "out" / LOCK_FILE).exists()


def _race(folder: Path, wins: Any, start: Any, done: Any) -> None:
    start.wait()
    try:
        acquire(folder)
        wins.put(os.getpid())
    except OutputInUseError:
        pass
    done.wait()  # a winner that exited at once would leave a stale lock for the slower racers


@pytest.mark.parametrize("stale", [False, True])
def test_exactly_one_of_racing_writers_gets_the_lock(tmp_path: Path, stale: bool) -> None:
    if stale:
        (tmp_path / LOCK_FILE).write_text(f"{socket.gethostname()} 999999999\n")  # no such PID
    context = multiprocessing.get_context("fork")
    wins, start, done = context.Queue(), context.Barrier(6), context.Barrier(6)
    racers = [context.Process(target=_race, args=(tmp_path, wins, start, done)) for _ in range(6)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for racer in racers:
            racer.start()
        for racer in racers:
            racer.join()
    winners = [wins.get(timeout=5) for _ in range(wins.qsize())] if not wins.empty() else []
    assert len(winners) == 1, winners
    assert (tmp_path / LOCK_FILE).read_text().split()[1] == str(winners[0])


# --- unwritable output folders fail before any work --------------------------------------------------


def test_unwritable_output_dir_is_named_before_any_work(tmp_path: Path) -> None:
    """A path under a regular file can never be created, even by root (chmod would not stop root).
    Every target below does not exist either: reaching the model load would raise another error."""
    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "out"
    needle = rf"output_dir='{bad}' is not writable"
    with pytest.raises(PermissionError, match=needle):
        run_eval(_eval_cfg(bad, target="/no/such/target"))
    with pytest.raises(PermissionError, match=needle):
        run_distill(smoke_cfg(tmp_path, f"output_dir={bad}", "target.name=/no/such/target"))
    with pytest.raises(PermissionError, match=needle):
        run_benchmark(BenchmarkConfig(target=TargetConfig(name="/no/such/target"), output_dir=str(bad)))
    with pytest.raises(PermissionError, match=needle):
        run_fit(FitRouterConfig(labels=str(tmp_path / "no_such_labels.jsonl"), output_dir=str(bad)))
    with pytest.raises(PermissionError, match=needle):
        run_demo(DemoConfig(output_dir=str(bad)))
    collect = from_dict(
        CollectConfig,
        {
            "target": {"name": "/no/such/target"},
            "output": str(bad / "labels.jsonl"),
            "drafters": [{"name": "a", "kind": "derived"}, {"name": "b", "kind": "derived"}],
        },
    )
    with pytest.raises(PermissionError, match=rf"output='{bad}' is not writable"):
        run_collect(collect, progress=False)
