"""Nothing runs, nothing lies: no pickle runs on resume, a killed demo leaves no stage behind, the
GGUF cache serves only the file it converted, sweeps of other configs are not merged, and bad
values and damaged files are named before any work."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from torch import nn

from specdecode.core.locking import LOCK_FILE, OutputInUseError
from specdecode.decoding.decode import autoregressive_generate, speculative_generate
from specdecode.decoding.sampling import SamplingParams
from specdecode.evaluation.config import EvalConfig
from specdecode.evaluation.report import merge_results
from specdecode.models import gguf_cache
from specdecode.models.config import TargetConfig
from specdecode.models.drafters import derive_drafter
from specdecode.models.feature_drafter import derive_feature_drafter
from specdecode.models.loading import load_model
from specdecode.pipeline.stages import Stage, run_stages
from specdecode.routing.embedders import HashingEmbedder
from specdecode.routing.router import Router, RouterMLP
from specdecode.training import checkpoints
from specdecode.training.config import TrainConfig
from specdecode.training.job import run_distill
from specdecode.training.loop import BudgetSchedule
from tests.models_for_tests import tiny_llama
from tests.test_train import smoke_cfg

ROOT = Path(__file__).resolve().parents[1]


# --- 1. a checkpoint never unpickles code ----------------------------------------------------------


class _Payload:
    """Unpickled in full, this creates `marker`: the code a planted checkpoint file would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return open, (self.marker, "w")


def test_a_pickle_planted_as_the_scheduler_state_never_runs(tmp_path: Path) -> None:
    """accelerate loads `custom_checkpoint_<i>.pkl` with weights_only=False: such a file is
    refused before any work, naming it, and its code does not run."""
    args = ("train.max_steps=2", "train.checkpoint_every=2", "train.eval_every=2")
    run_distill(smoke_cfg(tmp_path, *args))
    checkpoint = tmp_path / "out" / "checkpoints" / "checkpoint_2"
    assert (checkpoint / checkpoints.SCHEDULER_FILE).is_file() and not list(checkpoint.glob("custom_checkpoint_*"))
    marker = tmp_path / "payload-ran"
    torch.save(_Payload(marker), checkpoint / "custom_checkpoint_0.pkl")
    with pytest.raises(
        ValueError, match=r"checkpoint_2 holds custom_checkpoint_0.pkl: accelerate loads such files with full pickle"
    ):
        run_distill(smoke_cfg(tmp_path, "train.max_steps=4", *args[1:], "train.resume=true"))
    assert not marker.exists()


def _accelerator(
    folder: Path,
) -> tuple[Accelerator, nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    accelerator = Accelerator(cpu=True, project_config=checkpoints.project_configuration(folder, 3))
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, BudgetSchedule(3, "linear"))
    return accelerator, model, optimizer, scheduler


@pytest.mark.parametrize("name", ["random_states_0.pkl", "optimizer.bin", "pytorch_model.bin", checkpoints.BEST_FILE])
def test_a_pickle_planted_in_any_checkpoint_file_never_runs(tmp_path: Path, name: str) -> None:
    """Every other file loads with weights_only=True: the planted one is named as unreadable and
    the resume falls back to the checkpoint before it, its code never run."""
    accelerator, model, optimizer, scheduler = _accelerator(tmp_path)
    folder = checkpoints.checkpoint_folder(accelerator)
    for step in (1, 2):
        optimizer.step()
        scheduler.step()
        checkpoints.save_checkpoint(accelerator, folder, checkpoints.LoopState(step=step), {}, scheduler=scheduler)
    saved = json.loads((folder / "checkpoint_1" / checkpoints.SCHEDULER_FILE).read_text())
    marker = tmp_path / "payload-ran"
    torch.save(_Payload(marker), folder / "checkpoint_2" / name)
    fresh = torch.optim.lr_scheduler.LambdaLR(optimizer, BudgetSchedule(3, "linear"))
    with pytest.warns(UserWarning, match=rf"checkpoint_2/{name} is unreadable .*falling back"):
        state, _ = checkpoints.resume(accelerator, folder, scheduler=fresh)
    assert not marker.exists()
    assert state.step == 1 and fresh.state_dict() == saved and fresh.last_epoch == 1


# --- 2. a killed demo leaves no stage running, and a rerun never clears a live one -----------------


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its reaper does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def _launch_a_stage(out: Path) -> None:
    """What the demo does for a launched stage, with an app that writes its PID and sleeps: a
    launcher process (as `accelerate launch`) that starts the app and waits for it."""
    from specdecode.pipeline.launch import run_tied

    app = f"import os, time; open({str(out / 'app')!r}, 'w').write(str(os.getpid())); time.sleep(30)"
    launcher = (
        f"import os, subprocess, sys; open({str(out / 'launcher')!r}, 'w').write(str(os.getpid())); "
        f"subprocess.run([sys.executable, '-c', {app!r}])"
    )
    run_tied([sys.executable, "-c", launcher])


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
@pytest.mark.parametrize(
    "signum", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=["SIGKILL", "SIGTERM", "SIGINT"]
)
def test_a_launched_stage_and_its_children_die_with_the_demo(tmp_path: Path, signum: int) -> None:
    """The launcher and the app it starts both end within seconds of the process that launched
    them (a fork of this one, standing for the demo), however it ends."""
    demo = multiprocessing.get_context("fork").Process(target=_launch_a_stage, args=(tmp_path,))
    demo.start()
    pids: list[int] = []
    try:
        assert _wait_for(lambda: (tmp_path / "app").is_file() and (tmp_path / "app").read_text() != "", 30), (
            "the app never started"
        )
        pids = [int((tmp_path / name).read_text()) for name in ("launcher", "app")]
        os.kill(demo.pid, signum)
        demo.join(timeout=10)
        assert _wait_for(lambda: not any(map(_alive, pids)), 20), f"left running: {[p for p in pids if _alive(p)]}"
    finally:
        demo.kill()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_rerun_never_clears_a_live_stages_folder(tmp_path: Path) -> None:
    """A stage's staging folder whose lock a live process holds (a stage a killed run left
    running) is refused, untouched; one whose holder is dead is cleared and the stage runs."""
    staging = tmp_path / ".tmp.eval"
    staging.mkdir()
    (staging / "partial.json").write_text("{}")
    ran: list[Path] = []

    def run(config: dict, out: Path) -> None:
        ran.append(out)
        (out / "results.json").write_text("{}")

    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        (staging / LOCK_FILE).write_text(f"{socket.gethostname()} {sleeper.pid}\n")
        with pytest.raises(
            OutputInUseError, match=rf"stage 'eval''s folder '{staging}' is in use by PID {sleeper.pid}"
        ):
            run_stages([Stage("eval", {}, run)], tmp_path)
        assert ran == [] and sorted(p.name for p in staging.iterdir()) == [LOCK_FILE, "partial.json"]
    finally:
        sleeper.kill()
        sleeper.wait()
    run_stages([Stage("eval", {}, run)], tmp_path)  # its holder is gone now
    assert len(ran) == 1 and (tmp_path / "eval" / "results.json").is_file() and not staging.exists()


def _demo_command(out: Path) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "eval" / "demo.py"),
        "--config-name",
        "demo_smoke",
        f"output_dir={out}",
        f"distill=['experiment=smoke','cache_dir={out}/teacher_cache']",
        "eval=['target.name=smoke','synthetic=true','undistilled.num_layers=1','undistilled.draft_vocab=null',"
        "'prompts_per_domain=2','max_prompt_tokens=96','max_new_tokens=4','gamma=2','temperatures=[0.0,1.0]','batch_sizes=[1]']",
    ]


def _tagged(tag: str) -> list[int]:
    """PIDs of the live processes whose environment holds `tag`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if tag.encode() in (entry / "environ").read_bytes() and _alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _measured(results: dict) -> list[tuple]:
    """What a rerun must reproduce: every row's acceptance and exactness (tokens/s are timings;
    the oracle's picks follow timed pass costs)."""
    return sorted(
        (
            r["domain"],
            r["method"],
            r["gamma"],
            r["temperature"],
            r["batch_size"],
            r["alpha"],
            r["tau"],
            r["exact_match"],
        )
        for r in results["rows"]
        if r["method"] not in ("oracle",)
    )


@pytest.fixture(scope="module")
def uninterrupted_demo(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("straight") / "demo"
    completed = subprocess.run(_demo_command(out), capture_output=True, text=True, timeout=1200)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the demo's processes through /proc")
@pytest.mark.parametrize(
    "signum, stage",
    [(signal.SIGKILL, "distill-code"), (signal.SIGTERM, "eval")],
    ids=["SIGKILL-in-distill-code", "SIGTERM-in-eval"],
)
def test_a_demo_killed_in_a_launched_stage_leaves_nothing_running_and_reruns_to_the_same_results(
    tmp_path: Path, uninterrupted_demo: dict, signum: int, stage: str
) -> None:
    """`eval/demo.py` under `accelerate launch` (the launcher a user types), killed while a stage's
    app runs: within seconds no process of it is left, and the rerun finishes with the
    uninterrupted run's acceptance in every row."""
    out = tmp_path / "demo"
    tag = f"SPECDECODE_TEST_TAG={uuid.uuid4().hex}"
    env = os.environ | {tag.split("=")[0]: tag.split("=")[1]}
    demo = subprocess.Popen(_demo_command(out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # the stage's app holds its staging folder's lock while it runs
        assert _wait_for(lambda: (out / f".tmp.{stage}" / LOCK_FILE).is_file() or demo.poll() is not None, 900)
        assert demo.poll() is None, "the demo ended before the stage ran"
        demo.send_signal(signum)
        demo.wait(timeout=30)
        assert _wait_for(lambda: not _tagged(tag), 20), f"left running: {_tagged(tag)}"
    finally:
        demo.kill()
        for pid in _tagged(tag):
            os.kill(pid, signal.SIGKILL)
    rerun = subprocess.run(_demo_command(out), capture_output=True, text=True, timeout=1200)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _measured(json.loads((out / "results.json").read_text())) == _measured(uninterrupted_demo)


# --- 3. the GGUF cache serves only the file it converted -------------------------------------------


def test_gguf_cache_tells_apart_same_named_same_sized_files_that_differ_late(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two `model.gguf` files of 5 MB differing in their last byte (another late layer's weights)
    are two entries, each converted from its own file; the whole-file hash is computed once per
    file version."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    converted: list[Path] = []

    def convert(gguf: Path, out: Path) -> None:
        converted.append(gguf)
        (out / "source.bin").write_bytes(gguf.read_bytes()[-1:])

    monkeypatch.setattr(gguf_cache, "_convert_gguf", convert)
    files = []
    for name, last in (("a", b"\1"), ("b", b"\2")):
        path = tmp_path / name / "model.gguf"
        path.parent.mkdir()
        path.write_bytes(b"GGUF" + b"\0" * (5 * 2**20) + last)
        files.append(path)
    first, second = (gguf_cache.gguf_to_hf_folder(f) for f in files)
    assert first != second and converted == files
    assert (first / "source.bin").read_bytes() == b"\1" and (second / "source.bin").read_bytes() == b"\2"
    # a second load reads the remembered hash and the entry: no conversion, no rehash
    hashes: list[str] = []
    monkeypatch.setattr(gguf_cache, "hashlib", SimpleNamespace(sha256=_counting_sha256(hashes)))
    assert gguf_cache.gguf_to_hf_folder(files[0]) == first and converted == files
    assert hashes == ["path"]  # only the (path, size, mtime, inode) lookup key was hashed
    # rewritten in place with the same size: a new mtime, hashed again, a new entry
    files[0].write_bytes(b"GGUF" + b"\0" * (5 * 2**20) + b"\3")
    os.utime(files[0], ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    assert gguf_cache.gguf_to_hf_folder(files[0]) not in (first, second)


def _counting_sha256(calls: list[str]) -> Callable[..., Any]:
    """hashlib.sha256, recording each call as a hash of a short key ("path") or of content."""

    def sha256(data: bytes = b"") -> Any:
        calls.append("path" if data else "content")
        return hashlib.sha256(data)

    return sha256


# --- 4. a sweep report never merges runs of other configs ------------------------------------------


def test_merging_runs_of_different_configs_is_refused_naming_the_keys(tmp_path: Path) -> None:
    """`-m gamma=1,2` with 2 prompts at T 0, then `-m gamma=3` with 3 prompts at T 1.0, into one
    folder: one report would show the first run's config over all three."""
    runs = {1: (2, [0.0]), 2: (2, [0.0]), 3: (3, [1.0])}
    for gamma, (prompts, temperatures) in runs.items():
        folder = tmp_path / f"gamma={gamma}"
        folder.mkdir()
        config = {
            "gamma": gamma,
            "prompts_per_domain": prompts,
            "temperatures": temperatures,
            "output_dir": str(folder),
            "target": {"name": "smoke"},
        }
        (folder / "results.json").write_text(json.dumps({"rows": [], "config": config}))
    with pytest.raises(
        ValueError,
        match=r"(?s)differing keys:\n  prompts_per_domain: 2 in .*gamma=1/results.json, 3 in .*gamma=3/results.json"
        r"\n  temperatures: \[0.0\] in .*, \[1.0\] in .*gamma=3/results.json",
    ):
        merge_results(tmp_path.glob("*/results.json"))
    shutil.rmtree(tmp_path / "gamma=3")
    assert len(merge_results(tmp_path.glob("*/results.json"))["sources"]) == 2  # one sweep: gamma and folders differ


# --- 5. values that would run and give wrong results are refused first -----------------------------


@pytest.mark.parametrize(
    "build, needle",
    [
        (
            lambda: SamplingParams(temperature=1e-40),
            r"temperature must be a finite number >= 0.0001, or 0 \(greedy\), got 1e-40",
        ),
        (
            lambda: EvalConfig(methods=["autoregressive"], temperatures=[1e-40]),
            r"temperatures=1e-40: a finite number >= 0.0001, or 0 \(greedy\)",
        ),
        (
            lambda: TrainConfig(temperature=1e-40),
            r"train.temperature=1e-40: a finite number >= 0.0001, or 0 \(greedy\)",
        ),
        (lambda: TrainConfig(max_grad_norm=-1.0), r"train.max_grad_norm=-1.0: a finite number > 0"),
        (lambda: TrainConfig(max_grad_norm=0.0), r"train.max_grad_norm=0.0: a finite number > 0"),
        (lambda: TrainConfig(lr=float("inf")), r"train.lr=inf: a finite number > 0"),
        (lambda: TrainConfig(weight_decay=-1.0), r"train.weight_decay=-1.0: a finite number >= 0"),
        (lambda: TrainConfig(seed=-1), r"train.seed=-1: an int in \[0, 2\*\*32\)"),
        (lambda: EvalConfig(methods=["autoregressive"], domains=[]), r"domains=\[\]: a non-empty list"),
        (lambda: EvalConfig(methods=["autoregressive"], temperatures=[]), r"temperatures=\[\]: a non-empty list"),
        (lambda: EvalConfig(methods=["autoregressive"], batch_sizes=[]), r"batch_sizes=\[\]: a non-empty list"),
    ],
)
def test_values_that_would_run_wrong_are_refused_naming_the_key_and_range(
    build: Callable[[], Any], needle: str
) -> None:
    with pytest.raises(ValueError, match=needle):
        build()


def test_temperature_below_the_floor_is_refused_before_any_decode(make_tiny_llama) -> None:
    target = make_tiny_llama()
    calls: list[int] = []
    handle = target.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError, match="got 1e-40"):
            autoregressive_generate(target, [[1, 2]], max_new_tokens=4, temperature=1e-40)
    finally:
        handle.remove()
    assert calls == []
    result = autoregressive_generate(target, [[1, 2]], max_new_tokens=4, temperature=1e-4, seed=0, eos_token_ids=[])
    assert len(result.sequences[0]) == 4


def test_a_nan_loss_stops_training_without_saving_a_drafter(tmp_path: Path) -> None:
    """lr 1e30 is finite, so the config passes; the first step sends the weights to inf and the
    next loss is NaN: training stops there, naming the step, and writes no drafter."""
    with pytest.raises(FloatingPointError, match=r"training loss is nan at step 2 .*stopped without saving a drafter"):
        run_distill(smoke_cfg(tmp_path, "train.max_steps=3", "train.lr=1e30", "train.warmup_steps=0"))
    assert not (tmp_path / "out" / "drafter").exists() and not (tmp_path / "out" / "metrics.json").exists()


# --- 6. damaged files and mismatched models are named ------------------------------------------------


@pytest.fixture
def target_folder(tmp_path: Path, make_tiny_llama, make_tiny_tokenizer) -> Path:
    folder = tmp_path / "target"
    make_tiny_llama().save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_a_damaged_model_file_is_named(target_folder: Path, damage: str) -> None:
    weights = target_folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2] if damage == "truncated" else b"")
    with pytest.raises(
        ValueError, match=rf"'{weights}' is not a readable safetensors file .*truncated, empty or damaged"
    ):
        load_model(target_folder)


def test_a_damaged_fusion_layer_is_named(tmp_path: Path, make_tiny_llama, make_tiny_tokenizer) -> None:
    folder = tmp_path / "feature"
    derive_feature_drafter(make_tiny_llama(), 1).save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    fc = folder / "feature_fc.safetensors"
    fc.write_bytes(fc.read_bytes()[:40])
    with pytest.raises(ValueError, match=rf"'{fc}' is not a readable safetensors file"):
        load_model(folder)


def test_a_drafter_folder_without_tokenizer_files_is_named(tmp_path: Path, make_tiny_llama) -> None:
    folder = tmp_path / "drafter"
    derive_drafter(make_tiny_llama(), 1).save_pretrained(folder)
    with pytest.raises(
        ValueError, match=rf"model folder '{folder}' has no tokenizer files .*tokenizer.save_pretrained"
    ):
        load_model(folder)


def _saved_router(folder: Path) -> Path:
    features, drafters, domains = 16, ["code", "generic"], ["chat", "code"]
    router = Router(
        RouterMLP(features, len(domains), hidden=8, dropout=0.0),
        HashingEmbedder(16),
        drafters,
        domains,
        torch.zeros(features),
        torch.ones(features),
        torch.ones(len(domains), len(drafters)),
        embedder_spec={"kind": "hashing", "name": "hashing", "dim": 16},
    )
    router.save(folder)
    assert Router.load(folder).drafters == drafters
    return folder


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda c: "{not json", r"router.json' is not valid JSON"),  # JSONDecodeError
        (lambda c: json.dumps([c]), r"router.json' holds a JSON list, not a router's settings"),
        (
            lambda c: json.dumps({k: v for k, v in c.items() if k != "drafters"}),
            r"router.json' has no 'drafters' entry",
        ),  # KeyError
        (
            lambda c: json.dumps(c | {"drafters": []}),
            r"router.json': drafters=\[\]: expected a non-empty list of names",
        ),  # IndexError
        (lambda c: json.dumps(c | {"hidden": "8"}), r"router.json': hidden='8': expected an int >= 1"),  # TypeError
        (
            lambda c: json.dumps(c | {"drafters": ["code", "generic", "math"]}),
            r"router.safetensors' does not hold the router",
        ),
    ],
)
def test_a_malformed_router_json_is_named(tmp_path: Path, edit: Callable[[dict], str], needle: str) -> None:
    folder = _saved_router(tmp_path / "router")
    path = folder / "router.json"
    path.write_text(edit(json.loads(path.read_text())))
    with pytest.raises(ValueError, match=needle):
        Router.load(folder)


def test_a_truncated_router_safetensors_is_named(tmp_path: Path) -> None:
    folder = _saved_router(tmp_path / "router")
    tensors = folder / "router.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:-10])
    with pytest.raises(ValueError, match=rf"'{tensors}' is not a readable safetensors file"):
        Router.load(folder)


def test_a_non_utf8_data_file_names_the_line(tmp_path: Path) -> None:
    from specdecode.data.files import read_data_file

    for name, text in (
        ("data.jsonl", b'{"prompt": "ok", "response": "x"}\n{"prompt": "caf\xe9", "response": "x"}\n'),
        ("data.csv", b"prompt,response\nok,x\ncaf\xe9,x\n"),
    ):
        path = tmp_path / name
        path.write_bytes(text)
        line = 2 if name.endswith(".jsonl") else 3
        with pytest.raises(ValueError, match=rf"'{path}' line {line} is not UTF-8 text .*save the file as UTF-8"):
            read_data_file(path)


def test_a_feature_drafter_of_another_hidden_size_is_named_before_drafting(make_tiny_llama) -> None:
    target = make_tiny_llama()
    other = derive_feature_drafter(make_tiny_llama(hidden_size=48), 1)
    calls: list[int] = []
    handle = target.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(
            ValueError, match=r"reads target states \[-1\] of width 48, but the target's hidden size is 32"
        ):
            speculative_generate(target, other, [[1, 2, 3]], max_new_tokens=4, gamma=2)
    finally:
        handle.remove()
    assert calls == []


def test_token_ids_from_numpy_and_tensors_are_ids_and_a_float_eos_is_refused() -> None:
    target, drafter = tiny_llama(2, seed=0), tiny_llama(1, seed=1)
    plain = speculative_generate(target, drafter, [[1, 2, 3]], max_new_tokens=6, gamma=2)
    ids = torch.tensor([1, 2, 3])
    for prompt in ([np.int64(1), np.int32(2), np.int64(3)], [ids[0], ids[1], ids[2]], ids, np.array([1, 2, 3])):
        assert speculative_generate(target, drafter, [prompt], max_new_tokens=6, gamma=2).sequences == plain.sequences
    assert (
        speculative_generate(
            target, drafter, [[1, 2, 3]], max_new_tokens=6, gamma=2, eos_token_ids=np.int64(5)
        ).sequences
        is not None
    )
    with pytest.raises(ValueError, match=r"eos_token_ids must be an int token id, a list of them or None, got 1.0"):
        speculative_generate(target, drafter, [[1, 2, 3]], max_new_tokens=6, gamma=2, eos_token_ids=1.0)
    with pytest.raises(ValueError, match=r"prompt 0 holds 2.0 \(float\): token ids are ints"):
        speculative_generate(target, drafter, [[1, 2.0, 3]], max_new_tokens=6, gamma=2)


def test_a_drafter_of_another_target_names_its_key(
    tmp_path: Path, target_folder: Path, make_tiny_llama, make_tiny_tokenizer
) -> None:
    from specdecode.evaluation.suite import run_eval

    folder = tmp_path / "code"
    derive_drafter(make_tiny_llama(), 1).save_pretrained(folder)
    make_tiny_tokenizer([f"v{i}" for i in range(3, 64)]).save_pretrained(folder)  # another target's vocabulary
    cfg = EvalConfig(
        target=TargetConfig(name=str(target_folder)),
        drafters={"code": str(folder)},
        domains=["code"],
        methods=["autoregressive", "specialized"],
        synthetic=True,
        batch_sizes=[1],
        gamma=2,
        prompts_per_domain=1,
        max_new_tokens=2,
        output_dir=str(tmp_path / "eval"),
    )
    with pytest.raises(ValueError, match=rf"^drafters.code='{folder}': target and drafter tokenizers differ"):
        run_eval(cfg)
