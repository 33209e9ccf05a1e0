"""Drafter training: smoke jobs end to end, exact resume after SIGKILL, DDP on CPU, configs."""

from __future__ import annotations

import json
import math
import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from specdecode.core.config import from_dict
from specdecode.data.config import DataConfig
from specdecode.models import load_model
from specdecode.models.config import DrafterConfig, TargetConfig
from specdecode.models.cpu_matmul import FEW_ROWS
from specdecode.models.smoke import smoke_target, smoke_tokenizer
from specdecode.training.checkpoints import complete_checkpoints
from specdecode.training.config import LossConfig, TrainConfig, TrainJobConfig
from specdecode.training.job import run_distill, run_finetune
from specdecode.training.loop import BudgetSchedule, DrafterLogits, budget_progress, global_batch_indices
from specdecode.training.sequences import (
    TrainSequence,
    decoding_prompts,
    load_examples,
    mix_limit,
    round_robin,
    round_robin_shares,
)
from specdecode.training.teacher import cache_key, concat_caches, dense_teacher_logits, score_topk

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
TRAIN_APPS = ("distill", "finetune")


def smoke_cfg(tmp_path: Path, *overrides: str, job: str = "distill") -> TrainJobConfig:
    """The smoke experiment composed as the apps do, writing under `tmp_path`."""
    base = ["experiment=smoke", f"output_dir={tmp_path / 'out'}", f"cache_dir={tmp_path / 'cache'}"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name=job, overrides=[*base, *overrides])
    return from_dict(TrainJobConfig, OmegaConf.to_container(cfg, resolve=True))


def run_app(
    job: str, tmp_path: Path, *overrides: str, launcher: list[str] | None = None
) -> subprocess.CompletedProcess:
    """Run train/<job>.py in a subprocess (single-threaded torch, as the fixtures do)."""
    command = [
        *(launcher or [sys.executable]),
        str(ROOT / "train" / f"{job}.py"),
        "experiment=smoke",
        f"output_dir={tmp_path / 'out'}",
        f"cache_dir={tmp_path / 'cache'}",
        *overrides,
    ]
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def spy_writer_shapes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int | None]]:
    """The (batch size, capacity) of each call the data writer makes, `torch.compile` a no-op."""
    import specdecode.training.sequences as sequences

    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)
    shapes: list[tuple[int, int | None]] = []
    generate = sequences.autoregressive_generate

    def spy(model, batch, **kwargs):  # type: ignore[no-untyped-def]
        shapes.append((len(batch), kwargs["capacity"]))
        return generate(model, batch, **kwargs)

    monkeypatch.setattr(sequences, "autoregressive_generate", spy)
    return shapes


def checkpoint_weights(output_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return torch.load(output_dir / "checkpoints" / f"checkpoint_{step}" / "pytorch_model.bin", weights_only=True)


def checkpoint_names(output_dir: Path) -> list[str]:
    """Every entry of `<output_dir>/checkpoints`, complete or not, by name."""
    return sorted(p.name for p in (output_dir / "checkpoints").iterdir())


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=atol, rtol=0), name


def test_distill_steps_raise_heldout_acceptance(tmp_path: Path) -> None:
    metrics = run_distill(smoke_cfg(tmp_path, "train.max_steps=8", "train.eval_every=4"))
    assert metrics["acceptance_best"] > metrics["acceptance_before"] + 0.05
    out = tmp_path / "out"
    assert json.loads((out / "metrics.json").read_text())["best_step"] == metrics["best_step"]
    assert OmegaConf.load(out / "config.yaml").loss.name == "forward_kl"
    drafter, tokenizer = load_model(out / "drafter")
    assert drafter.config.draft_vocab_ids is not None and len(tokenizer) == len(smoke_tokenizer())
    assert metrics["cpu_kernels"] == {"skinny_rows": None}  # plain linears by default


def test_metrics_record_the_targets_cpu_kernels(tmp_path: Path) -> None:
    metrics = run_distill(smoke_cfg(tmp_path, "skinny_matmul=true", "train.max_steps=1", "train.gamma_candidates=[]"))
    assert metrics["cpu_kernels"] == {"skinny_rows": list(FEW_ROWS)}


@pytest.mark.parametrize("loss", ["reverse_kl", "jsd", "tvd"])
def test_every_loss_trains(tmp_path: Path, loss: str) -> None:
    metrics = run_distill(smoke_cfg(tmp_path, f"loss={loss}", "train.max_steps=4"))
    assert metrics["acceptance_best"] > metrics["acceptance_before"]


def test_finetune_and_target_generated_sequences(tmp_path: Path) -> None:
    metrics = run_finetune(smoke_cfg(tmp_path, "train.seq_source=target", "train.max_steps=4", job="finetune"))
    assert metrics["loss"] == "cross_entropy" and metrics["steps"] == 4
    assert (tmp_path / "out" / "drafter" / "config.json").is_file()


def test_finetune_trains_a_feature_drafter_on_next_tokens(tmp_path: Path) -> None:
    """Fine-tuning a feature drafter: cross-entropy of every unrolled pass against the next token at
    the loss positions (the only loss here: no feature regression), falling with training; the
    saved folder is a feature drafter again."""
    from specdecode.models.feature_drafter import FeatureDrafter

    metrics = run_finetune(
        smoke_cfg(
            tmp_path,
            "drafter.kind=feature",
            "train.seq_source=target",
            "train.max_steps=30",
            "train.lr=2e-2",
            "train.log_every=1",
            "train.gamma_candidates=[]",
            "train.feature_loss_weight=0",
            job="finetune",
        )
    )
    assert metrics["loss"] == "cross_entropy" and metrics["drafter_kind"] == "feature" and metrics["steps"] == 30
    losses = [
        json.loads(line)["loss"]
        for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in line and "heldout" not in line
    ]
    assert len(losses) >= 10 and sum(losses[-5:]) < sum(losses[:5])
    drafter, _ = load_model(tmp_path / "out" / "drafter")
    assert isinstance(drafter, FeatureDrafter)


def test_bf16_autocast_trains_fp32_weights_and_is_recorded(tmp_path: Path) -> None:
    """train.mixed_precision=bf16 reaches the drafter's forward (the run differs from the fp32 one;
    the module's own test checks it is autocast), its weights stay fp32, its loss falls, and
    metrics.json says so. (Loss, not held-out acceptance: a feature drafter of the random smoke
    target is accepted ~1% of the time, so 12 steps move that by noise.)"""
    args = (
        "drafter.kind=feature",
        "train.seq_source=target",
        "train.max_steps=12",
        "train.checkpoint_every=6",
        "train.eval_every=6",
        "train.lr=2e-2",
        "train.gamma_candidates=[]",
        "train.log_every=1",
    )
    fp32 = run_distill(smoke_cfg(tmp_path / "a", *args))
    bf16 = run_distill(smoke_cfg(tmp_path / "b", *args, "train.mixed_precision=bf16"))
    assert (fp32["mixed_precision"], bf16["mixed_precision"]) == ("no", "bf16")
    losses = [
        json.loads(line)["loss"]
        for line in (tmp_path / "b" / "out" / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in line and "heldout" not in line
    ]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])
    a, b = (checkpoint_weights(tmp_path / d / "out", 12) for d in ("a", "b"))
    assert all(w.dtype == torch.float32 for w in b.values())
    assert any(not torch.equal(a[name], b[name]) for name in a)


def test_data_precision_writes_and_scores_only_the_training_split_in_bf16(tmp_path: Path) -> None:
    """train.data_precision=bf16: the training split's continuations and cached features come from a
    bf16 copy of the target (close to the fp32 ones, not equal), under keys of their own; the
    held-out split, which selection measures on, is the fp32 target's, byte for byte the same files."""
    from specdecode.training.store import read_store

    args = (
        "drafter.kind=feature",
        "train.seq_source=target",
        "train.max_steps=2",
        "train.eval_every=2",
        "train.gamma_candidates=[]",
    )
    runs = {p: run_distill(smoke_cfg(tmp_path / p, *args, f"train.data_precision={p}")) for p in ("no", "bf16")}
    assert (runs["no"]["data_dtype"], runs["bf16"]["data_dtype"]) == ("float32", "bfloat16")
    files = {p: {f.name: f for f in (tmp_path / p / "cache").iterdir()} for p in runs}
    held_out = {name for name in files["no"] if "heldout" in name}
    assert len(held_out) == 2 and held_out <= files["bf16"].keys()

    def contents(folder: Path) -> dict[str, bytes]:
        return {f.name: f.read_bytes() for f in folder.iterdir()}

    assert all(contents(files["no"][n]) == contents(files["bf16"][n]) for n in held_out)
    train = {p: [f for n, f in files[p].items() if n.startswith("distill-train-")] for p in runs}
    assert len(train["no"]) == len(train["bf16"]) == 1 and train["no"][0].name != train["bf16"][0].name
    # The prompts are the same tokens in both (the continuations may part): compare features there.
    prompts = []
    for p in ("no", "bf16"):
        cache = read_store(train[p][0])
        prompts.append(
            torch.cat(
                [
                    cache.features[start : start + seq.response_start].float()
                    for start, seq in zip(cache.token_offsets.tolist(), cache.sequences)
                ]
            )
        )
    fp32, bf16 = prompts
    assert fp32.shape == bf16.shape and not torch.equal(fp32, bf16)
    # rounding, not another model: ~0.07 on the random smoke target, ~1.4 between unrelated positions
    error = (fp32 - bf16).norm(dim=-1) / fp32.norm(dim=-1)
    assert error.mean() < 0.2 < ((fp32 - fp32.roll(1, 0)).norm(dim=-1) / fp32.norm(dim=-1)).mean()


@pytest.mark.parametrize("kind", ["derived", "feature"])
def test_train_agreement_is_scored_like_the_heldout_agreement(kind: str) -> None:
    """Each evaluation also reports `train_greedy`, the greedy agreement on the first training
    sequences, computed as the held-out `greedy` is: on a training split identical to the held-out
    one it must be the same figure, on another split another one; and the training log and
    history carry it under its own name."""
    from accelerate import Accelerator

    from specdecode.models.loading import build_drafter
    from specdecode.models.smoke import smoke_target
    from specdecode.training.feature_training import FeatureDrafterLogits
    from specdecode.training.objective import Objective, Teacher

    target = smoke_target()
    # a feature drafter copied from the target's last layer, in the layout with its final norm, so
    # that it agrees with the target at some positions and not all
    drafter_cfg = {"kind": kind, "num_layers": 1, "draft_vocab": None, "init_from_layer": -1, "layout": "specdecode"}
    cfg = from_dict(TrainJobConfig, {"drafter": drafter_cfg})
    generator = torch.Generator().manual_seed(3)
    vocab = target.config.vocab_size

    def split(n: int) -> list[TrainSequence]:
        return [
            TrainSequence(torch.randint(0, vocab, (int(length),), generator=generator).tolist(), 4)
            for length in torch.randint(8, 20, (n,), generator=generator)
        ]

    features = (-1,) if kind == "feature" else None
    heldout, other = (score_topk(target, split(n), 8, 0, features=features) for n in (10, 12))
    torch.manual_seed(0)
    drafter = build_drafter(cfg.drafter, target, smoke_tokenizer(), lambda: [])
    if kind == "feature":
        with torch.no_grad():
            drafter.fc.weight.normal_(0, 0.05)  # an untrained feature drafter agrees nowhere (see its init)
    model = FeatureDrafterLogits(drafter, 2) if kind == "feature" else DrafterLogits(drafter)
    figures = {}
    for name, train_cache in (("same", heldout), ("other", other)):
        teacher = Teacher(target, train_cache, heldout, 0, [], 8, kind == "feature")
        objective = Objective(cfg, "distill", teacher, drafter, Accelerator(cpu=True))
        objective.model = model
        figures[name] = objective.evaluate()
    same, other_split = figures["same"], figures["other"]
    assert 0 < same["greedy"] < 1
    assert same["train_greedy"] == pytest.approx(same["greedy"], abs=1e-6)
    assert other_split["greedy"] == pytest.approx(same["greedy"], abs=1e-6)
    assert other_split["train_greedy"] != pytest.approx(other_split["greedy"], abs=1e-6)


@pytest.mark.parametrize("decay, halfway", [("constant", 1.0), ("linear", 0.5), ("cosine", 0.5)])
def test_lr_schedule_warms_up_then_decays_over_the_budget(decay: str, halfway: float) -> None:
    schedule = BudgetSchedule(warmup_steps=4, decay=decay)
    assert [schedule(s) for s in (0, 2, 4, 9)] == pytest.approx([0.0, 0.5, 1.0, 1.0])
    schedule.progress = 0.5
    assert [schedule(2), schedule(9)] == pytest.approx([0.5 * halfway, halfway])
    schedule.progress = 1.0
    assert schedule(9) == pytest.approx(1.0 if decay == "constant" else 0.0)
    if decay == "cosine":
        schedule.progress = 0.25
        assert schedule(9) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_budget_progress_is_whichever_limit_is_nearer() -> None:
    by_steps = TrainConfig(max_steps=100)
    both = TrainConfig(max_steps=100, max_minutes=10)
    assert budget_progress(25, 590.0, by_steps) == pytest.approx(0.25)
    assert budget_progress(25, 300.0, both) == pytest.approx(0.5)
    assert budget_progress(75, 300.0, both) == pytest.approx(0.75)
    assert budget_progress(25, 900.0, both) == 1.0


def test_on_policy_steps_run_and_count_tokens(tmp_path: Path) -> None:
    metrics = run_distill(smoke_cfg(tmp_path, "train.lambda_on_policy=1.0", "train.max_steps=2"))
    assert metrics["steps"] == 2 and metrics["train_tokens"] > 0


def test_gradient_accumulation_matches_one_big_batch(tmp_path: Path) -> None:
    one = run_distill(smoke_cfg(tmp_path / "a", "train.max_steps=3", "train.checkpoint_every=3"))
    two = run_distill(smoke_cfg(tmp_path / "b", "train.max_steps=3", "train.checkpoint_every=3", "train.grad_accum=2"))
    assert one["train_tokens"] == two["train_tokens"]
    assert_same_weights(
        checkpoint_weights(tmp_path / "a" / "out", 3), checkpoint_weights(tmp_path / "b" / "out", 3), 1e-5
    )


@pytest.mark.parametrize(
    "drafter",
    [
        pytest.param((), marks=pytest.mark.slow),  # the feature case resumes the same loop and more state
        ("drafter.kind=feature", "train.seq_source=target", "train.feature_noise=0.5"),
    ],
    ids=["slice", "feature-with-noise"],
)
def test_resume_after_sigkill_ends_at_the_same_weights(tmp_path: Path, drafter: tuple[str, ...]) -> None:
    # Killed mid-warm-up: the resumed run must continue the scheduler, not restart it from lr 0.
    # ... and the linear decay over the 6 steps, whose progress the checkpoint carries; with
    # feature noise, the noise draws too (they come from the RNG state each checkpoint restores).
    args = (
        "train.max_steps=6",
        "train.checkpoint_every=2",
        "train.eval_every=2",
        "train.warmup_steps=4",
        "train.lr=1e-2",
        "train.lr_decay=linear",
        "train.max_new_tokens=8",  # short continuations to write (feature case): resume is exact at any length
        "train.gamma_candidates=[]",  # no gamma choice after training: the weights are compared
        *drafter,
    )
    run_distill(smoke_cfg(tmp_path / "straight", *args))  # in this process; the killed run is the app's
    # step s (0-based) uses lr * min(1, s / 4) * (1 - s / 6)
    logged = [json.loads(line) for line in (tmp_path / "straight" / "out" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in logged if "lr" in r]
    assert lrs == pytest.approx([1e-2 * min(1, s / 4) * (1 - s / 6) for s in range(6)])
    # SIGKILLed after step 3 (the last checkpoint is step 2's): tests/kill_after_step.py hooks the loop
    killed = run_app(
        "distill",
        tmp_path / "killed",
        *args,
        launcher=[sys.executable, str(ROOT / "tests" / "kill_after_step.py"), "3"],
    )
    assert killed.returncode == -signal.SIGKILL
    assert checkpoint_names(tmp_path / "killed" / "out") == ["checkpoint_2"]
    assert not (tmp_path / "killed" / "out" / "drafter").exists()
    with pytest.warns(UserWarning, match="taking over the stale lock"):  # the killed run's
        run_distill(smoke_cfg(tmp_path / "killed", *args, "train.resume=true"))
    assert "resumed_from_step" in (tmp_path / "killed" / "out" / "metrics.jsonl").read_text()
    assert_same_weights(
        checkpoint_weights(tmp_path / "straight" / "out", 6), checkpoint_weights(tmp_path / "killed" / "out", 6), 1e-6
    )
    a, b = (json.loads((tmp_path / d / "out" / "metrics.json").read_text()) for d in ("straight", "killed"))
    assert (
        a["acceptance_best"] == pytest.approx(b["acceptance_best"], abs=1e-6) and a["train_tokens"] == b["train_tokens"]
    )


# `--multi_gpu` picks accelerate's torchrun launcher; with no GPU the processes fall back to gloo on
# the CPU (MULTI_CPU). `--cpu --num_processes 2` would need mpirun in accelerate 1.x.
TWO_PROCESSES = [
    sys.executable,
    "-m",
    "accelerate.commands.launch",
    "--multi_gpu",
    "--num_processes",
    "2",
    "--num_machines",
    "1",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
]


def test_ddp_on_cpu_matches_one_process(tmp_path: Path) -> None:
    args = ("train.max_steps=3", "train.checkpoint_every=3", "train.gamma_candidates=[]")  # the weights are compared
    run_distill(smoke_cfg(tmp_path / "one", *args))  # one process: this one
    ddp = run_app("distill", tmp_path / "two", *args, launcher=TWO_PROCESSES)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    a, b = (json.loads((tmp_path / d / "out" / "metrics.json").read_text()) for d in ("one", "two"))
    assert b["num_processes"] == 2 and a["train_tokens"] == b["train_tokens"]
    assert a["acceptance_best"] == pytest.approx(b["acceptance_best"], abs=1e-5)
    assert_same_weights(
        checkpoint_weights(tmp_path / "one" / "out", 3), checkpoint_weights(tmp_path / "two" / "out", 3), 1e-5
    )


def test_a_target_sharded_over_two_processes_trains_as_one_whole_target_does(tmp_path: Path) -> None:
    """`train.shard_target`: each of 2 processes holds half of every decoder layer (FSDP2 over gloo),
    and the online teacher's forwards give the weights and acceptance of one process's whole target."""
    # 17 held-out sequences: shared out unevenly, the processes would make unequal numbers of forwards
    args = ("train.max_steps=3", "train.checkpoint_every=3", "train.gamma_candidates=[]", "train.teacher=online")
    args = (*args, "train.heldout_sequences=17")
    run_distill(smoke_cfg(tmp_path / "one", *args))
    sharded = run_app("distill", tmp_path / "two", *args, "train.shard_target=true", launcher=TWO_PROCESSES)
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    a, b = (json.loads((tmp_path / d / "out" / "metrics.json").read_text()) for d in ("one", "two"))
    target = smoke_target()
    layers = sum(p.numel() for p in target.model.layers.parameters()) / sum(p.numel() for p in target.parameters())
    assert a["target_held"] == 1.0 and b["target_held"] == pytest.approx(1 - layers / 2)
    assert b["teacher"] == "online" and b["num_processes"] == 2 and a["train_tokens"] == b["train_tokens"]
    assert a["acceptance_best"] == pytest.approx(b["acceptance_best"], abs=1e-5)
    assert_same_weights(
        checkpoint_weights(tmp_path / "one" / "out", 3), checkpoint_weights(tmp_path / "two" / "out", 3), 1e-5
    )


def test_a_sharded_target_with_the_teacher_auto_on_a_cpu_is_named_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"train.teacher='auto' is offline on cpu: train.shard_target needs online"):
        run_distill(smoke_cfg(tmp_path, "train.shard_target=true", "train.gamma_candidates=[]"))
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out" / "checkpoints").exists()


# The config groups of distill.yaml / finetune.yaml (other apps' groups are tested with them).
TRAIN_GROUPS = ("target", "drafter", "data", "loss", "experiment")


def _group_options() -> list[tuple[str, str]]:
    return [
        (group, yaml.stem)
        for group in TRAIN_GROUPS
        for yaml in sorted((CONF / group).glob("*.yaml"))
        if group != "experiment" or yaml.stem == "smoke"
    ]


@pytest.mark.parametrize("job", TRAIN_APPS)
@pytest.mark.parametrize("group, option", _group_options())
def test_every_group_option_composes_with_the_smoke_overrides(
    tmp_path: Path, job: str, group: str, option: str
) -> None:
    extra = ["drafter.path=some/drafter"] if (group, option) == ("drafter", "pretrained") else []
    if group == "experiment":
        cfg = smoke_cfg(tmp_path, "train.max_steps=2", "train.resume=true", job=job)
    else:
        cfg = smoke_cfg(tmp_path, f"{group}={option}", *extra, "train.max_steps=2", "train.resume=true", job=job)
    assert cfg.train.max_steps == 2 and cfg.train.resume and cfg.output_dir == str(tmp_path / "out")


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF / "accelerate").glob("*.yaml")))
def test_accelerate_configs_load(name: str) -> None:
    from accelerate.commands.config.config_args import ClusterConfig

    with initialize_config_dir(config_dir=str(CONF / "accelerate"), version_base="1.3"):
        assert compose(config_name=name).num_machines == 1
    assert ClusterConfig.from_yaml_file(str(CONF / "accelerate" / f"{name}.yaml")).num_machines == 1


@pytest.mark.parametrize(
    "build, needle",
    [
        (lambda: LossConfig(name="klx"), r"loss.name='klx': unknown; valid: forward_kl"),
        (
            lambda: DataConfig(source="file", path="/no/such/data.jsonl"),
            r"data.path \(domain 'code'\)='/no/such/data.jsonl': does not exist",
        ),
        (lambda: DataConfig(source="file"), r"data.path \(domain 'code'\)=None"),
        (lambda: DataConfig(name="mix", domains=["code", "poetry"]), r"unknown domain 'poetry'"),
        (lambda: DataConfig(chat_turns="later"), r"data.chat_turns='later': opening\|all"),
        (lambda: TrainConfig(lambda_on_policy=1.5), r"train.lambda_on_policy=1.5: must be in \[0, 1\]"),
        (lambda: TrainConfig(lambda_on_policy=-0.1), r"train.lambda_on_policy=-0.1"),
        (lambda: TrainConfig(seq_source="web"), r"train.seq_source='web'"),
        (lambda: TrainConfig(batch_size=6, grad_accum=4), r"train.batch_size=6"),
        (lambda: TrainConfig(temperature=float("inf")), r"train.temperature=inf: a finite number"),
        (lambda: DrafterConfig(kind="feature", feature_layers=[4]), r"drafter.feature_layers=\[4\]: expected distinct"),
        (lambda: TrainConfig(lr_decay="step"), r"train.lr_decay='step': constant\|linear\|cosine"),
        (lambda: TrainConfig(mixed_precision="fp8"), r"train.mixed_precision='fp8': auto\|no\|bf16\|fp16"),
        (lambda: TrainConfig(feature_noise=-0.1), r"train.feature_noise=-0.1: a finite number >= 0"),
        (lambda: TrainConfig(data_precision="int8"), r"train.data_precision='int8': auto\|no\|bf16\|fp16"),
        (lambda: TrainConfig(gamma_prompts=-1), r"train.gamma_prompts=-1: an int >= 0"),
        (lambda: TrainConfig(gamma_new_tokens=1), r"train.gamma_new_tokens=1: an int >= 2"),
        (
            lambda: TrainConfig(keep_checkpoints=1),
            r"train.keep_checkpoints=1: at least 2 \(accelerate deletes the oldest",
        ),
        (lambda: TrainConfig(generation_batch=0), r"train.generation_batch=0: an int >= 1"),
        (lambda: TrainConfig(shard_target="yes"), r"train.shard_target='yes': true or false"),
        (lambda: TrainConfig(shard_target=True, teacher="offline"), r"train.teacher='offline': online"),
        (lambda: TrainConfig(shard_target=True, seq_source="target"), r"train.seq_source='target': data with"),
        (lambda: TrainConfig(shard_target=True, seq_source="data"), r"train.gamma_candidates=\[1, 2, 3, 4, 5, 6, 8\]"),
        (
            lambda: TrainConfig(shard_target=True, seq_source="data", gamma_candidates=[], lambda_on_policy=0.5),
            r"train.lambda_on_policy=0.5: 0 with train.shard_target",
        ),
        (lambda: from_dict(TrainJobConfig, {"train": {"max_stepz": 3}}), r"train.max_stepz"),
    ],
)
def test_bad_config_names_the_field(build, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        build()


def test_drafter_with_another_tokenizer_is_rejected_before_training(
    tmp_path: Path, make_tiny_llama, make_tiny_tokenizer
) -> None:
    folder = tmp_path / "foreign"
    make_tiny_llama(vocab_size=259).save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    cfg = smoke_cfg(tmp_path, "drafter=pretrained", f"drafter.path={folder}")
    with pytest.raises(ValueError, match=r"drafter.path=.*tokenizer is not the target's"):
        run_distill(cfg)
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_wandb_logger_without_wandb_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: find_spec is None, import fails
    with pytest.raises(ImportError, match="pip install wandb"):
        run_distill(smoke_cfg(tmp_path, "logger=wandb"))
    assert not (tmp_path / "out" / "checkpoints").exists()


def wandb_records(run_file: Path) -> list[Any]:
    """The protobuf `Record`s of a wandb run's transaction log (`run-<id>.wandb`, what offline mode
    writes instead of uploading): a 7-byte header (b":W&B", magic, version), then a LevelDB log:
    32 KiB blocks of chunks, each `crc32 (4) | length (2) | type (1) | payload`, type 1 a whole
    record and 2 / 3 / 4 its first / middle / last piece."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", f"{run_file} is not a wandb transaction log: {data[:7]!r}"
    records, pieces, position = [], b"", 7
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a chunk header is padding
            position += 32768 - position % 32768
            continue
        crc, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if position + 7 + length > len(data):  # a chunk still being written: the records so far
            break
        payload = data[position + 7 : position + 7 + length]
        assert zlib.crc32(bytes([kind]) + payload) == crc, f"{run_file}: bad chunk at byte {position}"
        position += 7 + length
        pieces += payload
        if kind in (1, 4):
            records.append(Record.FromString(pieces))
            pieces = b""
    return records


def finished_wandb_records(run_file: Path, timeout_s: float = 60.0) -> list[Any]:
    """The run's records once its `exit` record is in the file. wandb's service process writes the
    file; in one full-suite run on a fresh clone it was read with no history record at all right
    after the job returned (not reproduced in 5 runs under CPU load; cause not confirmed). If it was
    read before the service finished writing, this waits for the run's last record (polling, up to
    `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = wandb_records(run_file)
        if any(record.WhichOneof("record_type") == "exit" for record in records):
            return records
        assert time.monotonic() < deadline, f"{run_file}: no exit record after {timeout_s} s"
        time.sleep(0.2)


def updates(items: Any) -> dict[str, Any]:
    """`{key: value}` of wandb record items (history / summary / config rows: JSON-encoded values)."""
    return {".".join(item.nested_key) or item.key: json.loads(item.value_json) for item in items}


def test_wandb_logger_writes_an_offline_run_holding_the_logged_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    # offline, quiet, and nothing of wandb's written outside tmp_path
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    metrics = run_distill(
        smoke_cfg(tmp_path, "logger=wandb", "wandb_mode=offline", "train.max_steps=2", "train.eval_every=1")
    )

    (run_file,) = (tmp_path / "out" / "wandb").glob("offline-run-*/run-*.wandb")
    records = finished_wandb_records(run_file)
    # every record of metrics.jsonl (unchanged by the tracker) is in the run's history at its step
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"] for r in logged} == {0, 1, 2} and any("loss" in r for r in logged)
    history: dict[int, dict[str, Any]] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = updates(record.history.item)
            history.setdefault(row["_step"], {}).update(row)
    # Every row from step 1 on must be there. The step-0 row (the evaluation before training) is
    # checked where present: wandb's offline writer does not always keep it.
    assert {1, 2} <= set(history), [record.WhichOneof("record_type") for record in records]
    for record in logged:
        if record["step"] > 0 or record["step"] in history:
            assert history[record["step"]] == pytest.approx(history[record["step"]] | record), record
    # the job's outcome is in the summary, its config in the run's config
    summary: dict[str, Any] = {}
    config: dict[str, Any] = {}
    for record in records:
        if record.WhichOneof("record_type") == "summary":
            summary |= updates(record.summary.update)
        elif record.WhichOneof("record_type") == "config":
            config |= updates(record.config.update)
    assert summary["acceptance_best"] == pytest.approx(metrics["acceptance_best"]) and summary["steps"] == 2
    assert config["train"]["max_steps"] == 2 and config["logger"] == "wandb"


def test_global_batches_cover_each_epoch_and_are_reproducible() -> None:
    epoch = [i for step in range(5) for i in global_batch_indices(step, 4, 20, seed=3)]
    assert sorted(epoch) == list(range(20))
    assert global_batch_indices(7, 4, 20, seed=3) == global_batch_indices(7, 4, 20, seed=3)
    assert global_batch_indices(0, 4, 20, seed=3) != global_batch_indices(0, 4, 20, seed=4)


def test_dense_teacher_logits_keep_topk_draft_ids_only() -> None:
    vocab_to_draft = torch.tensor([-1, 0, 1, -1, 2])  # draft ids 1, 2, 4
    dense = dense_teacher_logits(torch.tensor([[4, 3, 1]]), torch.tensor([[5.0, 4.0, 3.0]]), vocab_to_draft, 3)
    assert dense.tolist() == [[3.0, float("-inf"), 5.0]]


@pytest.mark.parametrize("layers", ["[-1]", "[2,-1]"])
def test_feature_drafter_distills_from_cached_features_and_reloads(tmp_path: Path, layers: str) -> None:
    """drafter=feature: the cache keeps the target's features (of every layer it reads), unrolled
    training raises greedy acceptance, metrics carry both acceptance figures and epochs, the gamma
    is chosen from timed decodes, and the saved folder is a feature drafter of those layers again
    (greedy decoding with it equals the target's)."""
    from specdecode import autoregressive_generate, speculative_generate
    from specdecode.models.feature_drafter import FeatureDrafter
    from specdecode.training.store import read_store

    cfg = smoke_cfg(
        tmp_path,
        "drafter.kind=feature",
        "train.max_steps=40",
        "train.eval_every=20",
        "train.lr=2e-2",
        "train.seq_source=target",
        "train.seq_temperatures=[0.0,1.0]",
        "train.unroll_steps=2",
        f"drafter.feature_layers={layers}",
    )
    metrics = run_distill(cfg)
    assert metrics["drafter_kind"] == "feature" and metrics["selection_metric"] == "greedy acceptance"
    # the tiny random target's argmax is near-uniform noise, so progress shows in Σ min(p, q)
    assert max(h["expected"] for h in metrics["history"]) > metrics["history"][0]["expected"] + 0.04
    assert {"greedy", "expected", "train_greedy", "epochs"} <= metrics["history"][-1].keys() and metrics["epochs"] > 0
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["train_greedy"] <= 1 and "heldout_train_greedy" not in r for r in logged if "heldout_greedy" in r)
    caches = [read_store(p) for p in (tmp_path / "cache").glob("distill-train-*")]
    assert len(caches) == 1 and caches[0].features is not None
    # two temperatures: every prompt appears twice
    assert caches[0].features.shape[0] == int(caches[0].token_offsets[-1]) and len(caches[0].sequences) == 2 * 64
    drafter, _ = load_model(tmp_path / "out" / "drafter")
    target, _ = load_model("smoke")
    assert isinstance(drafter, FeatureDrafter) and list(drafter.feature_layers) == json.loads(layers)
    assert caches[0].features.shape[1] == drafter.feature_width == 64 * len(json.loads(layers))
    # training chose the gamma that decoded fastest, and stored it with the drafter
    assert drafter.config.specdecode_gamma == metrics["gamma"]["chosen"] in [1, 2, 3, 4, 5, 6, 8]
    assert drafter.config.specdecode_alpha == pytest.approx(metrics["acceptance_best"])
    # and its expected acceptance when sampled, where a sampled gamma="auto" decode starts each row
    sampled = drafter.config.specdecode_alpha_sampled
    assert sampled == {"temperature": 1.0, "alpha": pytest.approx(metrics["best"]["expected"])}
    # timed by decoding the whole held-out prompts (not the training sequences' cut ones)
    whole = decoding_prompts(cfg.data, smoke_tokenizer(), cfg.train.gamma_prompts)
    assert metrics["gamma"]["method"] == "timed decodes" and metrics["gamma"]["prompt_tokens"] == sum(map(len, whole))
    prompts = [s.tokens[: s.response_start] for s in caches[0].sequences[:3]]
    spec = speculative_generate(target, drafter, prompts, gamma=3, max_new_tokens=12, eos_token_ids=[])
    assert spec.sequences == autoregressive_generate(target, prompts, max_new_tokens=12, eos_token_ids=[]).sequences


def test_select_temperature_picks_the_metric_and_early_stop_ends_training(tmp_path: Path) -> None:
    metrics = run_distill(
        smoke_cfg(
            tmp_path,
            "train.select_temperature=1.0",
            "train.max_steps=40",
            "train.eval_every=1",
            "train.early_stop_evals=2",
            "train.lr=1.0",
        )
    )
    assert metrics["selection_metric"] == "expected acceptance at T=1.0"
    assert all(h["acceptance"] == h["expected"] for h in metrics["history"])
    # a huge learning rate stops improving fast: training ends well before max_steps
    assert metrics["steps"] < 40


def test_teacher_cache_key_follows_file_contents(tmp_path: Path) -> None:
    """Editing the data file or a local target's weights in place is a new cache, not a stale hit."""
    data_file, target_dir = tmp_path / "prompts.jsonl", tmp_path / "target"
    data_file.write_text('{"prompt": "a", "response": "b"}\n')
    target_dir.mkdir()
    (target_dir / "model.safetensors").write_bytes(b"weights")
    data = DataConfig(name="mine", source="file", path=str(data_file))
    target, train = TargetConfig(name=str(target_dir)), TrainConfig()

    def key() -> str:
        return cache_key(target, data, train, "train", 16, 8)

    first = key()
    assert key() == first
    data_file.write_text('{"prompt": "a", "response": "c"}\n')
    second = key()
    assert second != first
    (target_dir / "model.safetensors").write_bytes(b"retrained")
    os.utime(target_dir / "model.safetensors", ns=(0, 123))
    third = key()
    assert third != second
    # the job's dtype too: a bfloat16 target's continuations and logits are not the float32 ones
    assert cache_key(target, data, train, "train", 16, 8, dtype="bfloat16") != third


def test_teacher_topk_above_the_vocabulary_is_named_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"train.teacher_topk=100000 is more than the target's vocabulary of \d+"):
        run_distill(smoke_cfg(tmp_path, "train.teacher_topk=100000"))
    assert not (tmp_path / "cache").exists()


def test_data_file_without_usable_sequences_is_named(tmp_path: Path) -> None:
    """Prompts but no responses (seq_source=data): no sequence at all, and the error names the file and why."""
    path = tmp_path / "prompts_only.jsonl"
    path.write_text("".join(f'{{"prompt": "question {i}"}}\n' for i in range(40)))
    cfg = smoke_cfg(tmp_path, "data.source=file", f"data.path={path}")
    with pytest.raises(ValueError, match=r"data.path='.*prompts_only.jsonl': no usable train sequences: none of its"):
        run_distill(cfg)


def test_a_mix_domain_without_responses_is_named_before_the_mix_trains_without_it(tmp_path: Path) -> None:
    """With seq_source=data, a mix (the demo's generic drafter) must not silently drop a domain whose
    file has no responses: the file is named, with the settings that fix it."""
    path = tmp_path / "prompts_only.jsonl"
    path.write_text("".join(f'{{"prompt": "question {i}"}}\n' for i in range(40)))
    mine = {"name": "mine", "source": "file", "path": str(path)}
    mix = DataConfig(name="mix", domains=["code", "mine"], synthetic=True, members={"mine": mine})
    with pytest.raises(ValueError, match=r"prompts_only.jsonl': no usable train sequences: .*data.response_column"):
        mix_limit(mix, TrainConfig(seq_source="data"), "train", 8)
    assert mix_limit(mix, TrainConfig(seq_source="target"), "train", 8) == 16


def test_command_line_group_choices_beat_the_experiment(tmp_path: Path) -> None:
    """`experiment=smoke drafter=pretrained drafter.path=/nonexistent` used to train a derived drafter and exit 0."""
    cfg = smoke_cfg(tmp_path, "drafter=pretrained", "drafter.path=/nonexistent")
    assert (cfg.drafter.kind, cfg.drafter.path, cfg.target.name) == ("pretrained", "/nonexistent", "smoke")
    with pytest.raises(ValueError, match="drafter.path='/nonexistent' does not exist"):
        run_distill(cfg)
    assert not (tmp_path / "out" / "checkpoints").exists()
    assert smoke_cfg(tmp_path, "target=smollm2").target.name == "smollm2-135m-instruct"
    with pytest.raises(ValueError, match="drafter.path='/some/drafter': is set but drafter.kind='derived'"):
        smoke_cfg(tmp_path, "drafter.path=/some/drafter")


def test_resume_with_another_config_lists_the_differing_keys(tmp_path: Path) -> None:
    run_distill(smoke_cfg(tmp_path, "train.max_steps=2", "train.checkpoint_every=2"))
    with pytest.raises(
        ValueError, match=r"(?s)differing keys:\n  loss.name: 'forward_kl' in the checkpoint, 'tvd' now\nResume"
    ) as error:
        run_distill(smoke_cfg(tmp_path, "loss=tvd", "train.resume=true", "train.max_steps=4"))
    assert "train.max_steps:" not in str(error.value)
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["loss"] == "forward_kl"
    # Budgets, logging and checkpointing may change on resume.
    resumed = run_distill(
        smoke_cfg(tmp_path, "train.resume=true", "train.max_steps=4", "train.log_every=2", "train.checkpoint_every=4")
    )
    assert resumed["steps"] == 4 and "resumed_from_step" in (tmp_path / "out" / "metrics.jsonl").read_text()


def test_fresh_run_refuses_a_folder_holding_checkpoints(tmp_path: Path) -> None:
    """A fresh 6-step run in an old 600-step run's folder used to rotate its own checkpoints away."""
    old = tmp_path / "out" / "checkpoints" / "checkpoint_600"
    old.mkdir(parents=True)
    (old / "COMPLETE").write_text("ok")
    with pytest.raises(
        ValueError,
        match=r"already holds checkpoints of an earlier run \(newest: checkpoint_600\); pass train.resume=true",
    ):
        run_distill(smoke_cfg(tmp_path))
    assert [p.name for p in old.parent.iterdir()] == ["checkpoint_600"] and not (tmp_path / "cache").exists()


def test_checkpoints_sort_by_step_number_and_need_the_marker(tmp_path: Path) -> None:
    for step in (5, 999_999, 1_000_000, 1_000_001):
        (tmp_path / f"checkpoint_{step}").mkdir()
    for step in (5, 999_999, 1_000_000):
        (tmp_path / f"checkpoint_{step}" / "COMPLETE").write_text("ok")
    # as text, checkpoint_1000000 < checkpoint_5 < checkpoint_999999; 1_000_001 was never completed
    assert [p.name for p in complete_checkpoints(tmp_path)] == [
        "checkpoint_5",
        "checkpoint_999999",
        "checkpoint_1000000",
    ]
    assert complete_checkpoints(tmp_path)[-1].name == "checkpoint_1000000"


def test_accelerate_rotation_keeps_the_newest_checkpoints(tmp_path: Path) -> None:
    run_distill(smoke_cfg(tmp_path, "train.max_steps=5", "train.checkpoint_every=1", "train.keep_checkpoints=2"))
    assert checkpoint_names(tmp_path / "out") == ["checkpoint_4", "checkpoint_5"]
    assert all(
        (tmp_path / "out" / "checkpoints" / name / "COMPLETE").is_file() for name in ("checkpoint_4", "checkpoint_5")
    )


def test_debris_of_a_killed_save_is_never_loaded_and_removed_at_the_next_save(tmp_path: Path) -> None:
    """A folder without COMPLETE (a save killed mid-write) must not count toward accelerate's
    total_limit: it would rotate checkpoint_4, the one this run resumed from, away."""
    args = ("train.checkpoint_every=2", "train.eval_every=2")
    run_distill(smoke_cfg(tmp_path, "train.max_steps=4", *args))
    debris = tmp_path / "out" / "checkpoints" / "checkpoint_5"
    debris.mkdir()
    (debris / "pytorch_model.bin").write_bytes(b"junk")
    metrics = run_distill(smoke_cfg(tmp_path, "train.max_steps=6", *args, "train.resume=true"))
    assert metrics["steps"] == 6 and '"resumed_from_step": 4' in (tmp_path / "out" / "metrics.jsonl").read_text()
    assert checkpoint_names(tmp_path / "out") == ["checkpoint_4", "checkpoint_6"]


def test_resume_past_an_unreadable_checkpoint_deletes_it(tmp_path: Path) -> None:
    """checkpoint_4 is unreadable, so resume loads checkpoint_2: checkpoint_4 is a future this run
    no longer has, and left in place it would outrank (and outlive) the run's own checkpoint_3."""
    args = ("train.checkpoint_every=2", "train.eval_every=2")
    run_distill(smoke_cfg(tmp_path, "train.max_steps=4", *args))
    (tmp_path / "out" / "checkpoints" / "checkpoint_4" / "trainer_state.json").write_text("{trunc")
    with pytest.warns(UserWarning, match=r"checkpoint_4/trainer_state.json is unreadable"):
        metrics = run_distill(smoke_cfg(tmp_path, "train.max_steps=3", *args, "train.resume=true"))
    assert metrics["steps"] == 3 and '"resumed_from_step": 2' in (tmp_path / "out" / "metrics.jsonl").read_text()
    assert checkpoint_names(tmp_path / "out") == ["checkpoint_2", "checkpoint_3"]


def test_failed_or_repeated_save_leaves_the_checkpoints_as_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that raises (a full disk) removes its partial folder; saving a step twice is refused
    before accelerate's rotation deletes anything."""
    from accelerate import Accelerator

    from specdecode.training import checkpoints

    accelerator = Accelerator(cpu=True, project_config=checkpoints.project_configuration(tmp_path, 2))
    folder = checkpoints.checkpoint_folder(accelerator)
    for step in (1, 2):
        checkpoints.save_checkpoint(accelerator, folder, checkpoints.LoopState(step=step), {})
    with pytest.raises(ValueError, match=r"checkpoint_2 exists: step 2 was checkpointed already"):
        checkpoints.save_checkpoint(accelerator, folder, checkpoints.LoopState(step=2), {})
    assert checkpoint_names(tmp_path) == ["checkpoint_1", "checkpoint_2"]

    def full_disk(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoints.torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        checkpoints.save_checkpoint(accelerator, folder, checkpoints.LoopState(step=3), {})
    assert checkpoint_names(tmp_path) == ["checkpoint_2"]  # rotation ran first: why keep_checkpoints >= 2


def test_truncated_checkpoint_is_named_and_resume_falls_back(tmp_path: Path) -> None:
    args = ("train.max_steps=4", "train.checkpoint_every=2", "train.eval_every=2")
    run_distill(smoke_cfg(tmp_path, *args))
    straight = checkpoint_weights(tmp_path / "out", 4)
    weights = tmp_path / "out" / "checkpoints" / "checkpoint_4" / "pytorch_model.bin"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.warns(
        UserWarning, match=r"checkpoint file .*checkpoint_4/pytorch_model.bin is unreadable.*falling back"
    ):
        metrics = run_distill(smoke_cfg(tmp_path, *args, "train.resume=true"))
    assert metrics["steps"] == 4 and '"resumed_from_step": 2' in (tmp_path / "out" / "metrics.jsonl").read_text()
    assert_same_weights(straight, checkpoint_weights(tmp_path / "out", 4), 0.0)


def test_target_continuations_are_generated_once_for_both_drafter_kinds(tmp_path: Path, monkeypatch) -> None:
    """A slice drafter trained after a feature drafter on the same data reuses its sequences."""
    import specdecode.training.sequences

    common = ("train.seq_source=target", "train.max_steps=1", "train.gamma_candidates=[]")
    run_distill(smoke_cfg(tmp_path / "a", "drafter.kind=feature", *common, f"cache_dir={tmp_path / 'cache'}"))

    def no_generation(*args, **kwargs):
        raise AssertionError("target continuations were generated again")

    monkeypatch.setattr(specdecode.training.sequences, "autoregressive_generate", no_generation)
    run_distill(smoke_cfg(tmp_path / "b", *common, f"cache_dir={tmp_path / 'cache'}"))
    assert len(list((tmp_path / "cache").glob("sequences-train-*"))) == 1
    assert len(list((tmp_path / "cache").glob("distill-train-*"))) == 2


def test_generation_batch_sets_the_continuation_batches_and_keys_only_other_batchings(
    tmp_path: Path, monkeypatch
) -> None:
    """`train.generation_batch` prompts per target decoding; a batching other than the default is a
    new cache (its sampled continuations differ), the default hashes as before the knob existed."""
    import specdecode.training.sequences

    real, sizes = specdecode.training.sequences.autoregressive_generate, []

    def recording(model, prompts, **kwargs):
        sizes.append(len(prompts))
        return real(model, prompts, **kwargs)

    monkeypatch.setattr(specdecode.training.sequences, "autoregressive_generate", recording)
    cfg = smoke_cfg(
        tmp_path,
        "train.seq_source=target",
        "train.max_steps=1",
        "train.gamma_candidates=[]",
        "train.generation_batch=24",
        "train.heldout_sequences=10",
    )
    run_distill(cfg)
    # 64 training prompts and 10 held-out ones, 24 at a time
    assert sorted(sizes) == sorted([24, 24, 16, 10])

    def key(*overrides: str) -> str:
        c = smoke_cfg(tmp_path, *overrides)
        return cache_key(c.target, c.data, c.train, "train", 16, 64)

    assert key("train.seq_source=target", "train.generation_batch=24") != key("train.seq_source=target")
    assert key("train.generation_batch=24") == key()  # the dataset's responses: nothing is generated


def test_features_of_dataset_responses_are_refused_before_any_work() -> None:
    """Only the target's own continuations come with its features; asking for them with the
    dataset's responses is named before anything is generated."""
    from specdecode.training.sequences import build_sequences

    train = TrainConfig(seq_source="data")
    with pytest.raises(ValueError, match=r"train.seq_source='data': only the target's own continuations"):
        build_sequences([], smoke_tokenizer(), None, train, [0], None, feature_layers=[-1])  # type: ignore[arg-type]


@pytest.mark.parametrize("layers", ["[-1]", "[1,3,-1]"])
def test_a_feature_drafters_continuations_and_features_take_one_target_pass(
    tmp_path: Path, monkeypatch, layers: str
) -> None:
    """With `seq_source: target`, a feature drafter's features come from the decoding that wrote
    the continuations: no scoring forward runs (score_topk), and they equal what a forward over the
    finished sequences gives (fp16), except the last token's row, which the target never read: zero
    (budgets stop each continuation within `max_len`, so no sequence is cut after a read token)."""
    import specdecode.training.job_data
    from specdecode.training.store import read_store

    def no_forward(*args, **kwargs):
        raise AssertionError("a second target pass scored the continuations")

    monkeypatch.setattr(specdecode.training.job_data, "score_topk", no_forward)
    cfg = smoke_cfg(
        tmp_path,
        "drafter.kind=feature",
        f"drafter.feature_layers={layers}",
        "train.seq_source=target",
        "train.max_steps=2",
        "train.gamma_candidates=[]",
    )
    run_distill(cfg)
    monkeypatch.undo()
    [path] = (tmp_path / "cache").glob("distill-train-*")
    cache = read_store(path)
    target, _ = load_model("smoke")
    scored = score_topk(target, cache.sequences, 0, 0, features=json.loads(layers))
    assert (
        cache.features is not None
        and cache.features.dtype == torch.float16
        and torch.equal(cache.offsets, scored.offsets)
    )
    for i in range(len(cache.sequences)):
        ours, theirs = cache.sequence_features(i).float(), scored.sequence_features(i).float()
        torch.testing.assert_close(ours[:-1], theirs[:-1], atol=2e-3, rtol=2e-3)
        assert ours[-1].eq(0).all() and not theirs[-1].eq(0).all()


def test_compile_on_writes_the_training_data_with_the_static_core(tmp_path: Path, monkeypatch) -> None:
    """`compile: true` writes a feature drafter's data (continuations and features) with the static
    core under torch.compile; here torch.compile is the identity, so the static core runs eagerly
    (the compiled core's own equality is tests/test_static.py's, slow): the eager writer's data."""
    import specdecode.training.sequences as sequences
    from specdecode.training.store import read_store

    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)
    cores = []
    generate = sequences.autoregressive_generate

    def spy(*args, **kwargs):
        cores.append((kwargs["static"], kwargs["compile"]))
        return generate(*args, **kwargs)

    monkeypatch.setattr(sequences, "autoregressive_generate", spy)
    caches = {}
    for compile in (False, True):
        out = tmp_path / f"compile-{compile}"
        args = ("drafter.kind=feature", "train.seq_source=target", "train.seq_temperatures=[0.0]", "train.max_steps=1")
        run_distill(smoke_cfg(out, *args, "train.gamma_candidates=[]", f"compile={str(compile).lower()}"))
        [path] = (out / "cache").glob("distill-train-*")
        caches[compile] = read_store(path)
    assert set(cores) == {(False, False), (True, True)}
    eager, static = caches[False], caches[True]
    assert [s.tokens for s in static.sequences] == [s.tokens for s in eager.sequences]
    torch.testing.assert_close(static.features.float(), eager.features.float(), atol=2e-3, rtol=2e-3)


def test_auto_compile_writes_with_the_compiled_core_only_a_job_that_pays_its_compile(
    tmp_path: Path, monkeypatch
) -> None:
    """`compile: null` (auto) compiles the data writer where compiling is on by default for the device
    and the job writes at least `WRITER_COMPILE_MIN_TOKENS`; `compile: true` compiles whatever the size."""
    import specdecode.decoding.compiled as compiled
    import specdecode.training.sequences as sequences

    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)
    monkeypatch.setattr(compiled, "COMPILE_ON_CPU", True)  # the device's default: on, as on CUDA
    cores = []
    generate = sequences.autoregressive_generate

    def spy(*args, **kwargs):
        cores.append(kwargs["compile"])
        return generate(*args, **kwargs)

    monkeypatch.setattr(sequences, "autoregressive_generate", spy)
    args = ("drafter.kind=feature", "train.seq_source=target", "train.seq_temperatures=[0.0]", "train.max_steps=1")
    written = {}
    for setting, threshold in (("null", 10**9), ("null", 1), ("true", 10**9)):
        monkeypatch.setattr(sequences, "WRITER_COMPILE_MIN_TOKENS", threshold)
        cores.clear()
        run_distill(
            smoke_cfg(tmp_path / f"{setting}-{threshold}", *args, "train.gamma_candidates=[]", f"compile={setting}")
        )
        written[setting, threshold] = set(cores)
    assert written == {("null", 10**9): {False}, ("null", 1): {True}, ("true", 10**9): {True}}


def test_compiled_writer_batches_share_one_shape(monkeypatch) -> None:
    """Compiled, every batch of the data writer has one shape (each shape compiles for tens of
    seconds on a GPU): one cache capacity, the longest row's, and the last batch filled up with
    rows of no budget; the data is the eager writer's."""
    import specdecode.training.sequences as sequences
    from specdecode.decoding.static_buffers import pooled_bytes
    from tests.models_for_tests import tiny_llama

    shapes = spy_writer_shapes(monkeypatch)
    target = tiny_llama(2, seed=0)
    prompts = [[1 + i] * (2 + 3 * i) for i in range(7)]  # 2 to 20 tokens
    train = TrainConfig(max_new_tokens=6, max_len=24, max_prompt_tokens=20)
    written = {}
    for compile in (False, True):
        written[compile] = sequences.generate_continuations(
            target, prompts, train, [], seed=0, batch_size=3, temperature=0.0, feature_layers=(-1,), compile=compile
        )
    assert shapes[:3] == [(3, None), (3, None), (1, None)]
    assert shapes[3:] == [(3, 32)] * 3  # 20 + 4 (max_len) + 1, rounded up to a power of two
    assert pooled_bytes(target) == 0  # the compiled batches' buffers are not kept past the writer
    assert written[True][0] == written[False][0] and [len(r) for r in written[True][0]] == [6] * 6 + [4]
    for ours, eager in zip(written[True][1], written[False][1]):
        torch.testing.assert_close(ours.float(), eager.float(), atol=2e-3, rtol=2e-3)


def test_a_writer_at_several_temperatures_prefills_each_prompt_once(monkeypatch) -> None:
    """At several temperatures the eager writer continues each prompt at every one from one prefill:
    batches of `batch_size` rows (`batch_size // 2` prompts), the output temperature-major, the greedy
    continuations and their features the one-temperature writer's; compiled (`torch.compile` a no-op
    here), one call per temperature, the greedy part again the same."""
    import specdecode.training.sequences as sequences
    from tests.models_for_tests import tiny_llama

    shapes = spy_writer_shapes(monkeypatch)
    target = tiny_llama(2, seed=0)
    prompts = [[1 + i] * (2 + 3 * i) for i in range(7)]
    train = TrainConfig(max_new_tokens=6, max_len=24, max_prompt_tokens=20)
    write = partial(sequences.generate_continuations, target, prompts, train, [], seed=0, batch_size=4)
    alone, alone_read = write(temperature=0.0, feature_layers=(-1,))
    both, read = write(temperature=[0.0, 1.0], feature_layers=(-1,))
    assert shapes == [(4, None), (3, None)] + [(2, None)] * 3 + [(1, None)]
    assert len(both) == len(read) == 14 and both[:7] == alone and both[7:] != alone
    for ours, one in zip(read[:7], alone_read):
        torch.testing.assert_close(ours.float(), one.float(), atol=2e-3, rtol=2e-3)
    with pytest.raises(ValueError, match=r"non-empty list of them, got \[\]"):
        write(temperature=[])
    compiled, _ = write(temperature=[0.0, 1.0], compile=True)
    assert shapes[6:] == [(4, 32), (4, 32)] * 2 and compiled[:7] == alone and len(compiled) == 14


@pytest.mark.parametrize("layers", ["[-1]", "[1,3,-1]"])
def test_feature_drafter_batches_carry_the_features_of_their_own_sequences(
    tmp_path: Path, monkeypatch, layers: str
) -> None:
    """The features a feature drafter trains on are the target's hidden states of exactly the
    tokens in the batch (all the layers it reads); on-policy training, which it cannot do, is
    refused before any work."""
    from specdecode.models.feature_drafter import target_features
    from specdecode.training.feature_training import FeatureDrafterLogits

    seen = []
    original = FeatureDrafterLogits.forward

    def recording(self, input_ids, attention_mask, features, positions):
        seen.append((input_ids.clone(), attention_mask.clone(), features.clone()))
        return original(self, input_ids, attention_mask, features, positions)

    with pytest.raises(ValueError, match=r"train.lambda_on_policy=0.5: must be 0 with drafter.kind='feature'"):
        smoke_cfg(tmp_path, "drafter.kind=feature", "train.lambda_on_policy=0.5")
    monkeypatch.setattr(FeatureDrafterLogits, "forward", recording)
    run_distill(
        smoke_cfg(
            tmp_path,
            "drafter.kind=feature",
            f"drafter.feature_layers={layers}",
            "train.max_steps=4",
            "train.eval_every=100",
            "train.gamma_candidates=[]",
        )
    )
    target, _ = load_model("smoke")
    training = [s for s in seen if s[0].shape[0] == 8]  # the training batches (held-out chunks differ)
    assert len(training) >= 4
    with torch.no_grad():
        for input_ids, attention_mask, features in training:
            states = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
            expected = target_features(target, states, json.loads(layers))
            real = attention_mask.bool()
            torch.testing.assert_close(features[real], expected[real].half().float(), atol=2e-3, rtol=2e-3)


def test_cache_barriers_do_not_depend_on_what_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under DDP each process writes its shards of a missing store and the main process its manifest;
    every process must still pass the same barriers (accelerate's wait_for_everyone), whether the
    stores exist yet or not. A nested cached build once added barriers only the main process
    reached, and DDP hung."""
    from accelerate import Accelerator

    entered: list[int] = []
    real = Accelerator.wait_for_everyone

    def counting(self: Accelerator) -> Any:
        entered.append(1)
        return real(self)

    monkeypatch.setattr(Accelerator, "wait_for_everyone", counting)
    run_distill(smoke_cfg(tmp_path, "train.max_steps=0", "output_dir=" + str(tmp_path / "first")))
    fresh, entered[:] = len(entered), []
    run_distill(smoke_cfg(tmp_path, "train.max_steps=0", "output_dir=" + str(tmp_path / "second")))
    assert fresh == len(entered) > 0  # the second run found every cache the first one wrote


@pytest.mark.parametrize("sizes", [[5, 5, 5], [2, 7, 4], [0, 3, 1], [6]])
@pytest.mark.parametrize("limit", [None, 0, 1, 4, 7, 9, 100])
def test_round_robin_shares_are_the_prefix_of_the_interleaving(sizes: list[int], limit: int | None) -> None:
    """A mix built from each domain's first `share` items is the first `limit` items of the mix."""
    parts = [[(d, i) for i in range(n)] for d, n in enumerate(sizes)]
    shares = round_robin_shares(sizes, limit)
    expected = round_robin(parts) if limit is None else round_robin(parts)[:limit]
    assert round_robin([part[:n] for part, n in zip(parts, shares)]) == expected


@pytest.mark.parametrize("chat", [None, 12])
def test_mix_trains_on_its_domains_cached_sequences(tmp_path: Path, chat: int | None) -> None:
    """The generic (mix) drafter's data is the domain drafters' own: after the domain jobs, a mix
    job with their summed budget (`mix_limit`, as the demo sets it) generates and scores nothing
    and trains on all their sequences, also where a domain has fewer examples than the limit
    (held-out: code has 28, math 27, chat 37; the limit is 30), and where one domain takes more
    than the others (`train.train_sequences_per_domain`, which the mix then names for each)."""
    cache = tmp_path / "cache"
    target = ("train.seq_source=target", "train.max_steps=1", "train.gamma_candidates=[]")
    own = [f"train.train_sequences_per_domain.chat={chat}"] if chat else []
    for domain in ("code", "math", "chat"):
        metrics = run_distill(
            smoke_cfg(
                tmp_path / domain,
                f"data={domain}",
                f"cache_dir={cache}",
                "train.train_sequences=8",
                "train.heldout_sequences=30",
                *own,
                *target,
            )
        )
    assert metrics["train_sequences"] == (chat or 8)  # the chat job's
    before = {p: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert len(before) == 12  # per domain: train and held-out sequences, and their scored caches
    shares = [f"train.train_sequences_per_domain={{code:8,math:8,chat:{chat}}}"] if chat else []
    mix = smoke_cfg(tmp_path / "mix", "data=mix", *shares, *target)
    limits = [mix_limit(mix.data, mix.train, "train", 8), mix_limit(mix.data, mix.train, "heldout", 30)]
    assert limits == [16 + (chat or 8), 28 + 27 + 30]
    metrics = run_distill(
        smoke_cfg(
            tmp_path / "mix",
            "data=mix",
            f"cache_dir={cache}",
            f"train.train_sequences={limits[0]}",
            f"train.heldout_sequences={limits[1]}",
            *shares,
            *target,
        )
    )
    assert {p: p.stat().st_mtime_ns for p in cache.iterdir()} == before
    assert (metrics["train_sequences"], metrics["heldout_sequences"]) == (limits[0], 85)


def test_train_sequences_per_domain_names_domains_and_counts() -> None:
    assert TrainConfig(train_sequences_per_domain={"chat": 3}).train_sequences_per_domain == {"chat": 3}
    assert TrainConfig().train_sequences_per_domain == {"code": None, "math": None, "chat": None}
    assert TrainConfig(train_sequences_per_domain={"support": 3}).train_sequences_per_domain == {"support": 3}
    for bad in ({"bad name": 3}, {"chat": 0}, {"chat": 2.5}, [3]):
        with pytest.raises(ValueError, match="train.train_sequences_per_domain"):
            TrainConfig(train_sequences_per_domain=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("features", [False, True])
def test_concatenated_caches_equal_one_cache_of_all_sequences(features: bool) -> None:
    target, _ = load_model("smoke")
    torch.manual_seed(0)
    sequences = [
        TrainSequence(torch.randint(0, 90, (n,)).tolist(), start) for n, start in ((9, 3), (12, 5), (7, 2), (10, 9))
    ]
    layers = (1, -1) if features else None
    whole = score_topk(target, sequences, 0 if features else 8, pad_id=0, features=layers)
    parts = concat_caches(
        [
            score_topk(target, sequences[:1], 0 if features else 8, 0, features=layers),
            score_topk(target, sequences[1:], 0 if features else 8, 0, features=layers),
        ]
    )
    assert parts.sequences == whole.sequences
    for name in ("offsets", "topk_ids", "topk_logits", "token_offsets", "features"):
        a, b = getattr(parts, name), getattr(whole, name)
        assert (a is None) == (b is None) == (name in ("token_offsets", "features") and not features), name
        if a is not None:
            assert a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=1e-3), name


def test_positions_whose_top_k_holds_no_draft_id_are_dropped_in_order() -> None:
    from specdecode.training.objective import drop_positions_without_teacher

    vocab_to_draft = torch.tensor([0, 1, -1, -1, 2])  # ids 2 and 3 are outside the draft vocabulary
    positions = torch.tensor([[False, True, True], [True, True, False]])
    ids = torch.tensor([[0, 2], [2, 3], [3, 4], [3, 2]])  # the 2nd and 4th positions have no draft id
    logits = torch.arange(8.0).view(4, 2)
    kept, kept_ids, kept_logits = drop_positions_without_teacher(positions, ids, logits, vocab_to_draft)
    assert kept.tolist() == [[False, True, False], [True, False, False]]
    assert kept_ids.tolist() == [[0, 2], [3, 4]] and kept_logits.tolist() == [[0.0, 1.0], [4.0, 5.0]]
    assert int(kept.sum()) == len(kept_ids)


def test_the_gamma_choice_decodes_whole_heldout_prompts() -> None:
    """Training sequences cut prompts to max_prompt_tokens; the prompts the gamma choice decodes
    are the held-out split's whole, chat-formatted, in order: prompt lookup copies from them."""
    from specdecode.data.domains import format_prompt, load_domain
    from specdecode.training.sequences import decoding_prompts

    _, tokenizer = load_model("smoke")
    data = DataConfig(source="synthetic", domains=["code", "math"])
    prompts = decoding_prompts(data, tokenizer, 5)
    heldout = [format_prompt(tokenizer, ex.prompt) for ex in load_examples(data, "heldout")]
    assert prompts == heldout[:5] and len(prompts) == 5
    assert max(map(len, prompts)) > TrainConfig(max_prompt_tokens=8).max_prompt_tokens  # whole, not cut
    train_prompts = {
        tuple(format_prompt(tokenizer, ex.prompt)) for ex in load_domain("code", source="synthetic", split="train")
    }
    assert not train_prompts & {tuple(p) for p in prompts}


def test_the_job_times_decodes_of_whole_prompts_that_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With training prompts cut to 4 tokens, the gamma choice still decodes the whole ones; prompts
    with no room for gamma_new_tokens in the target's context are left out, and with none left
    Leviathan's model decides instead of the run failing after training. The smoke target's context
    is cut from 512 to 128 tokens here, so that the decodes which fill it stay short."""
    import specdecode.models.smoke as smoke

    context, smoke_target = 128, smoke.smoke_target

    def short_context_target(*args: Any, **kwargs: Any) -> torch.nn.Module:
        target = smoke_target(*args, **kwargs)
        target.config.max_position_embeddings = context
        return target

    monkeypatch.setattr(smoke, "smoke_target", short_context_target)
    cfg = smoke_cfg(
        tmp_path,
        "train.max_steps=1",
        "train.max_prompt_tokens=4",
        "train.gamma_candidates=[1,2]",
        "train.gamma_prompts=3",
        "train.gamma_new_tokens=4",
    )
    gamma = run_distill(cfg)["gamma"]
    whole = decoding_prompts(cfg.data, smoke_tokenizer(), 3)
    assert gamma["method"] == "timed decodes" and gamma["prompts"] == 3
    assert gamma["prompt_tokens"] == sum(map(len, whole)) > 3 * 4
    assert gamma["chosen"] in (1, 2) and set(gamma["tau"]) == set(gamma["measured_speedups"]) == {1, 2}
    shortest = min(map(len, whole))
    room = smoke_cfg(
        tmp_path / "room",
        "train.max_steps=1",
        "train.gamma_candidates=[1,2]",
        "train.gamma_prompts=3",
        f"train.gamma_new_tokens={context - shortest}",
    )
    fits = run_distill(room)["gamma"]
    assert (
        fits["prompts"] == sum(len(p) == shortest for p in whole) >= 1
        and fits["prompt_tokens"] == fits["prompts"] * shortest
    )
    none = smoke_cfg(
        tmp_path / "none",
        "train.max_steps=1",
        "train.gamma_candidates=[1,2]",
        "train.gamma_prompts=3",
        f"train.gamma_new_tokens={context - shortest + 1}",
    )
    assert run_distill(none)["gamma"]["method"] == "Leviathan's model at alpha"
