"""The teacher store (specdecode.training.store) and the online teacher: a store killed mid-write
resumes to the same tensors, processes write disjoint shards that cover every sequence, reading
holds one shard whatever the store's size, and online and offline teachers give the same loss."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from specdecode.models import load_model
from specdecode.training.config import TrainConfig
from specdecode.training.job import run_distill
from specdecode.training.job_data import teacher_mode
from specdecode.training.loop import global_batch_indices
from specdecode.training.sequences import TrainSequence
from specdecode.training.store import (
    MANIFEST,
    TeacherStore,
    finish_store,
    read_store,
    shard_path,
    shard_ranges,
    write_shards,
)
from specdecode.training.teacher import TeacherCache, save_cache, score_topk
from tests.test_train import ROOT, run_app, smoke_cfg, spy_writer_shapes


def scored_sequences(count: int, features: bool, seed: int = 0) -> TeacherCache:
    """The smoke target's top-k logits (or features) on `count` random sequences of 6-17 tokens."""
    target, _ = load_model("smoke")
    generator = torch.Generator().manual_seed(seed)
    sequences = [
        TrainSequence(torch.randint(1, 200, (int(n),), generator=generator).tolist(), 3)
        for n in torch.randint(6, 18, (count,), generator=generator)
    ]
    return score_topk(target, sequences, 0 if features else 8, 0, features=(-1,) if features else None)


def assert_same_cache(a: TeacherCache, b: TeacherCache) -> None:
    assert a.sequences == b.sequences
    for name in ("offsets", "topk_ids", "topk_logits", "features", "token_offsets"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x, y), name


@pytest.mark.parametrize("features", [False, True])
def test_two_processes_write_disjoint_shards_covering_all_sequences(tmp_path: Path, features: bool) -> None:
    """Ranks 0 and 1 of 2 each write their own shards (none twice, none missed); the store then
    holds every sequence and the target's outputs on it in order, as one process's store does."""
    cache = scored_sequences(11, features)
    ranges = shard_ranges(11, 3)
    assert ranges == [(0, 3), (3, 6), (6, 9), (9, 11)]

    def write(start: int, stop: int, path: Path) -> None:
        save_cache(cache.select(range(start, stop)), path)

    two, one = tmp_path / "two", tmp_path / "one"
    assert not finish_store(two, ranges)  # nothing written: no manifest
    mine = [set(write_shards(two, ranges, write, rank, 2)) for rank in (0, 1)]
    assert not mine[0] & mine[1] and mine[0] | mine[1] == {shard_path(two, a, b) for a, b in ranges}
    assert mine[0] == {shard_path(two, *ranges[0]), shard_path(two, *ranges[2])}
    assert write_shards(two, ranges, write, 0, 2) == []  # complete shards are skipped
    assert finish_store(two, ranges) and (two / MANIFEST).is_file()
    write_shards(one, ranges, write)
    finish_store(one, ranges)
    assert_same_cache(read_store(two), cache)
    assert_same_cache(read_store(two), read_store(one))
    store = TeacherStore.open(two)
    assert len(store) == 11 and store.num_positions == cache.num_positions
    assert_same_cache(store.select([7, 0, 10, 7]), cache.select([7, 0, 10, 7]))
    assert store.sequences[-1] == cache.sequences[-1] and store.sequences[2:5] == cache.sequences[2:5]


def test_a_store_killed_mid_write_resumes_and_yields_the_same_tensors(tmp_path: Path) -> None:
    """A job SIGKILLed as it publishes its second training shard (tests/kill_after_shard.py) leaves
    the first shard and a temp file, no manifest; the rerun keeps the first shard as it was, writes
    the rest and yields the store, tensor for tensor, of a run never killed (continuations sampled
    at T = 1 and the target's features included)."""
    args = (
        "drafter.kind=feature",
        "train.seq_source=target",
        "train.generation_batch=8",  # shards of 32 prompts: 2 for the 64 training prompts
        "train.max_new_tokens=8",  # short continuations: the store is the same whatever their length
        "train.max_steps=1",
        "train.gamma_candidates=[]",
    )
    run_distill(smoke_cfg(tmp_path / "straight", *args))  # in this process; the killed run is the app's
    killer = [sys.executable, str(ROOT / "tests" / "kill_after_shard.py"), "2"]
    killed = run_app("distill", tmp_path / "killed", *args, launcher=killer)
    assert killed.returncode == -signal.SIGKILL
    # shards published in order: training shard 1 (its scored store's, then its sequences'), then shard 2
    [folder] = (tmp_path / "killed" / "cache").glob("distill-train-*")
    [first] = [p for p in folder.iterdir() if not p.name.startswith(".")]
    assert first == shard_path(folder, 0, 32) and len(list(folder.glob(".*.tmp"))) == 1
    assert not (folder / MANIFEST).exists()
    before = (first.stat().st_ino, first.stat().st_mtime_ns)
    with pytest.warns(UserWarning, match="taking over the stale lock"):  # the killed run's
        run_distill(smoke_cfg(tmp_path / "killed", *args))
    assert (first.stat().st_ino, first.stat().st_mtime_ns) == before and not list(folder.glob(".*.tmp"))
    [reference] = (tmp_path / "straight" / "cache").glob("distill-train-*")
    assert reference.name == folder.name
    ours, theirs = read_store(folder), read_store(reference)
    assert ours.features is not None and len(ours.sequences) == 64
    assert_same_cache(ours, theirs)


def test_reading_a_store_holds_one_shard_open_whatever_its_size(tmp_path: Path) -> None:
    """An epoch of random batches, as training reads them, from stores of 32 and 256 sequences
    (shards of 16): the reader never holds more than one shard open, and its peak resident memory,
    measured in a fresh process, does not grow with the store (the large one is 56 MB bigger)."""
    width, length = 4096, 32  # 256 KB of fp16 features per sequence
    peaks = {}
    for count in (32, 256):
        folder = tmp_path / f"store-{count}"
        ranges = shard_ranges(count, 16)
        for start, stop in ranges:
            sequences = [TrainSequence(list(range(1, length + 1)), 8) for _ in range(start, stop)]
            rows = (stop - start) * length
            cache = TeacherCache(
                sequences,
                torch.arange(0, (stop - start + 1) * (length - 8), length - 8),
                torch.zeros(rows - (stop - start) * 8, 0, dtype=torch.int32),
                torch.zeros(rows - (stop - start) * 8, 0),
                torch.randn(rows, width).half(),
                torch.arange(0, rows + 1, length),
            )
            save_cache(cache, shard_path(folder, start, stop))
        assert finish_store(folder, ranges)
        store = TeacherStore.open(folder)
        for step in range(count // 8):
            batch = store.select(global_batch_indices(step, 8, count, seed=0))
            assert batch.features.shape == (8 * length, width) and store.resident_shards <= 1
        peaks[count] = _peak_reading(folder)
    assert peaks[256] - peaks[32] < 24, peaks


def _peak_reading(folder: Path) -> float:
    """Peak RSS growth in MiB of a fresh process reading an epoch of batches of 8 from `folder`."""
    script = f"""
import resource, torch
from specdecode.training.loop import global_batch_indices
from specdecode.training.store import TeacherStore
store = TeacherStore.open(__import__("pathlib").Path({str(folder)!r}))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for step in range(len(store) // 8):
    store.select(global_batch_indices(step, 8, len(store), seed=0))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)
"""
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


@pytest.mark.parametrize("kind", ["derived", "feature"])
def test_online_and_offline_teachers_give_the_same_loss_on_the_same_batch(tmp_path: Path, kind: str) -> None:
    """At equal data and seed, the target's outputs read from the store (offline) and computed in
    the step (online) give the same loss on the same batches and the same held-out figures; online
    writes the sequences only (a slice drafter distils from top-k logits, a feature drafter from
    the target's features)."""
    cache = tmp_path / "cache"
    common = (f"drafter.kind={kind}", "train.max_steps=3", "train.eval_every=3", "train.gamma_candidates=[]")
    offline = run_distill(smoke_cfg(tmp_path / "offline", *common, "train.teacher=offline", f"cache_dir={cache}"))
    stores = {p.name for p in cache.iterdir()}
    assert {n.split("-")[0] for n in stores} == {"sequences", "distill", "heldout"}
    online = run_distill(smoke_cfg(tmp_path / "online", *common, "train.teacher=online", f"cache_dir={cache}"))
    assert {p.name for p in cache.iterdir()} == stores  # the sequences were there: nothing written
    assert (offline["teacher"], online["teacher"]) == ("offline", "online")
    logged = {
        mode: [json.loads(line) for line in (tmp_path / mode / "out" / "metrics.jsonl").read_text().splitlines()]
        for mode in ("offline", "online")
    }
    losses = {mode: [r["loss"] for r in records if "loss" in r] for mode, records in logged.items()}
    assert len(losses["offline"]) == 3 and losses["online"] == pytest.approx(losses["offline"], rel=1e-5)
    for a, b in zip(offline["history"], online["history"]):
        assert a["greedy"] == pytest.approx(b["greedy"], abs=1e-6)
        assert a["expected"] == pytest.approx(b["expected"], rel=1e-5)
        assert a["train_greedy"] == pytest.approx(b["train_greedy"], abs=1e-6)


def test_online_writes_no_scored_store(tmp_path: Path) -> None:
    """Online from scratch: only the sequences' stores are written (training and held-out)."""
    metrics = run_distill(smoke_cfg(tmp_path, "train.teacher=online", "train.max_steps=1", "train.gamma_candidates=[]"))
    assert metrics["teacher"] == "online" and metrics["steps"] == 1
    assert sorted(p.name.split("-")[:2] for p in (tmp_path / "cache").iterdir()) == [
        ["sequences", "heldout"],
        ["sequences", "train"],
    ]


def test_teacher_auto_is_online_on_a_gpu_and_a_bad_value_is_named() -> None:
    assert teacher_mode("auto", torch.device("cuda", 0)) == "online"
    assert teacher_mode("auto", torch.device("cpu")) == "offline"
    assert teacher_mode("offline", torch.device("cuda")) == "offline"
    with pytest.raises(ValueError, match=r"train.teacher='gpu': online\|offline\|auto"):
        TrainConfig(teacher="gpu")


def test_a_sharded_compiled_writer_decodes_every_batch_in_one_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """`writer_plan` fixes one cache capacity over all of a job's prompts (a shard's own would differ
    from shard to shard, and each shape compiles anew), and with it a shard's last batch is filled
    up to the full batch size; a job of one batch keeps its own shape; auto does not compile on a CPU."""
    import specdecode.training.sequences as sequences
    from specdecode.training.sequences import writer_plan
    from tests.models_for_tests import tiny_llama

    train = TrainConfig(max_new_tokens=6, max_len=24, max_prompt_tokens=20, generation_batch=2, seq_temperatures=[0.0])
    prompts = [[1 + i] * (2 + 3 * i) for i in range(7)]  # 2 to 20 tokens
    cpu = torch.device("cpu")
    assert writer_plan(prompts, train, cpu, True) == (True, 32)  # 20 + 4 (max_len) + 1, rounded up
    assert writer_plan(prompts[:2], train, cpu, True) == (True, None)
    assert writer_plan(prompts, train, cpu, None) == writer_plan(prompts, train, cpu, False) == (False, None)

    shapes = spy_writer_shapes(monkeypatch)
    target = tiny_llama(2, seed=0)
    shard = prompts[:3]  # a shard of short prompts: on its own, a capacity of 16
    written = {
        capacity: sequences.generate_continuations(
            target, shard, train, [], seed=0, batch_size=2, temperature=0.0, compile=True, capacity=capacity
        )[0]
        for capacity in (32, None)
    }
    assert shapes == [(2, 32), (2, 32), (2, 16), (2, 16)]
    assert written[32] == written[None]


class SimulatedRank:
    """The part of an `Accelerator` a job's stores use, for process `index` of 2 run as a thread:
    `wait_for_everyone` is a barrier shared with the other one."""

    def __init__(self, index: int, world: int, barrier: threading.Barrier | None) -> None:
        self.process_index, self.num_processes, self.is_main_process = index, world, index == 0
        self.device = torch.device("cpu")
        self.barrier = barrier

    def wait_for_everyone(self) -> None:
        if self.barrier is not None:
            self.barrier.wait(timeout=300)


def test_a_jobs_two_processes_write_disjoint_shards_and_the_one_process_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`job_teacher` on processes 0 and 1 of 2 (threads with a shared barrier): each writes its own
    shards of every store, none twice, together all; both read the same complete stores, equal
    tensor for tensor to those one process writes (the target's continuations, sampled, and features)."""
    import specdecode.training.job_data as job_data

    target, tokenizer = load_model("smoke")
    written: dict[str, list[Path]] = {"rank-0": [], "rank-1": []}
    save = job_data.save_cache

    def recording(cache: TeacherCache, path: Path) -> None:
        written[threading.current_thread().name].append(path)
        save(cache, path)

    monkeypatch.setattr(job_data, "save_cache", recording)
    args = ("drafter.kind=feature", "train.seq_source=target", "train.generation_batch=8")
    cfg = smoke_cfg(tmp_path / "two", *args)
    barrier, teachers = threading.Barrier(2), {}

    def run(rank: int) -> None:
        teachers[rank] = job_data.job_teacher(cfg, "distill", target, tokenizer, SimulatedRank(rank, 2, barrier))  # type: ignore[arg-type]

    threads = [threading.Thread(target=run, args=(rank,), name=f"rank-{rank}") for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert set(teachers) == {0, 1}
    two = tmp_path / "two" / "cache"
    mine = [set(written["rank-0"]), set(written["rank-1"])]
    assert not mine[0] & mine[1] and mine[0] | mine[1] == set(two.rglob("*.safetensors"))
    # training: 2 shards of 32 prompts, one each (scored and sequences stores); held-out: 1 shard, process 0's
    assert len(written["rank-1"]) == 2 and len(written["rank-0"]) == 4
    assert all(p.name == "prompts-000000032-000000064.safetensors" for p in written["rank-1"])
    assert [len(t.train_cache) for t in teachers.values()] == [64, 64]
    monkeypatch.undo()

    job_data.job_teacher(smoke_cfg(tmp_path / "one", *args), "distill", target, tokenizer, SimulatedRank(0, 1, None))  # type: ignore[arg-type]
    one = tmp_path / "one" / "cache"
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in two.iterdir())
    for folder in one.iterdir():
        assert_same_cache(read_store(two / folder.name), read_store(folder))


def test_a_run_resumes_with_the_other_teacher(tmp_path: Path) -> None:
    """`train.teacher` may change on resume (the same losses either way): a run checkpointed offline
    continues online."""
    args = ("train.checkpoint_every=2", "train.eval_every=2", "train.gamma_candidates=[]")
    run_distill(smoke_cfg(tmp_path, *args, "train.max_steps=2", "train.teacher=offline"))
    metrics = run_distill(smoke_cfg(tmp_path, *args, "train.max_steps=3", "train.teacher=online", "train.resume=true"))
    assert metrics["steps"] == 3 and metrics["teacher"] == "online"
    assert '"resumed_from_step": 2' in (tmp_path / "out" / "metrics.jsonl").read_text()
