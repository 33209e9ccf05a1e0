"""The paths a GPU user runs, on a CUDA device: feature drafters decode exactly there (batch 1 and
ragged, with and without prompt lookup), a feature drafter's distillation job runs there in its
default precisions (bf16 autocast, bf16 training data), and the whole smoke demo runs there with
feature drafters and exact greedy rows.

Marked `gpu` (`make test` deselects them; `make test-gpu` runs them) and skipped without CUDA.
`SPECDECODE_GPU_TEST_DEVICE=cpu` runs the same tests on the CPU, to check them where no GPU is.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from specdecode import autoregressive_generate, speculative_generate
from specdecode.decoding.lookup import DEFAULT_LOOKUP
from specdecode.models.feature_drafter import FeatureDrafter
from specdecode.models.loading import load_model
from specdecode.pipeline.demo import run_demo
from specdecode.training.job import run_distill
from tests.models_for_tests import tiny_llama
from tests.test_demo import smoke_config
from tests.test_feature_drafter import hf_greedy, random_feature_drafter
from tests.test_train import smoke_cfg

DEVICE = os.environ.get("SPECDECODE_GPU_TEST_DEVICE", "cuda")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_gamma_auto_measures_the_device_and_stays_exact(ragged_prompts, tmp_path, monkeypatch) -> None:
    """gamma="auto" on the device: its step table timed there (every figure > 0), then any gamma
    schedule (a scripted one too) decodes token for token as transformers' greedy does."""
    from specdecode.decoding.costs import step_table
    from tests.test_adaptive import FLAT, Scripted

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    target = tiny_llama(3, seed=0).to(DEVICE)
    drafter = random_feature_drafter(target, feature_layers=(1, -1)).to(DEVICE)
    table = step_table(target, drafter, batch_sizes=(1, 8), context_tokens=32, repeats=2)
    assert table.batch_sizes == (1, 8) and all(s > 0 for row in table.seconds for s in row)
    expected = [hf_greedy(target, p, 20) for p in ragged_prompts]
    for gamma in ("auto", Scripted(FLAT, schedule=(0, 3, 1, 0, 4))):
        out = speculative_generate(target, drafter, ragged_prompts, gamma=gamma, max_new_tokens=20, eos_token_ids=[])
        assert out.sequences == expected


@pytest.mark.parametrize("lookup", [None, DEFAULT_LOOKUP], ids=["drafter", "with-lookup"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_feature_drafter_greedy_is_exact_on_the_device(ragged_prompts, lookup, gamma: int) -> None:
    target = tiny_llama(3, seed=0).to(DEVICE)
    drafter = random_feature_drafter(target, feature_layers=(1, -1)).to(DEVICE)
    # transformers' own greedy on the same device: the reference its kernels give there
    expected = [hf_greedy(target, p, 20) for p in ragged_prompts]
    batched = speculative_generate(
        target, drafter, ragged_prompts, gamma=gamma, max_new_tokens=20, eos_token_ids=[], prompt_lookup=lookup
    )
    single = speculative_generate(
        target, drafter, ragged_prompts[3:4], gamma=gamma, max_new_tokens=20, eos_token_ids=[], prompt_lookup=lookup
    )
    assert batched.sequences == expected and single.sequences == expected[3:4]
    # drafts were both accepted and rejected there: the rollback path ran on the device too
    assert 0 < batched.stats.accepted < batched.stats.drafted
    assert autoregressive_generate(target, ragged_prompts, max_new_tokens=20, eos_token_ids=[]).sequences == expected


def test_feature_drafter_job_runs_on_the_device_in_its_default_precisions(tmp_path: Path) -> None:
    """Target-written data with features (bf16 where the device computes it), bf16 autocast, the gamma
    timed there, and a saved drafter that decodes exactly on the device."""
    cfg = smoke_cfg(
        tmp_path,
        f"device={DEVICE}",
        "drafter.kind=feature",
        "train.seq_source=target",
        "train.seq_temperatures=[0.0,1.0]",
        "train.mixed_precision=auto",
        "train.data_precision=auto",
        "train.max_steps=12",
        "train.eval_every=6",
    )
    metrics = run_distill(cfg)
    assert metrics["drafter_kind"] == "feature" and metrics["steps"] == 12
    if DEVICE.startswith("cuda") and torch.cuda.is_bf16_supported():
        assert metrics["mixed_precision"] == "bf16" and metrics["data_dtype"] == "bfloat16"
    assert metrics["gamma"]["method"] == "timed decodes"
    drafter, _ = load_model(tmp_path / "out" / "drafter", device=DEVICE)
    target, _ = load_model("smoke", device=DEVICE)
    assert isinstance(drafter, FeatureDrafter) and drafter.fc.weight.device.type == torch.device(DEVICE).type
    prompts = [[5, 9, 3, 7, 1], [2, 4], [8, 8, 1, 6, 3, 2, 9]]
    spec = speculative_generate(target, drafter, prompts, max_new_tokens=12, eos_token_ids=[])
    assert spec.sequences == autoregressive_generate(target, prompts, max_new_tokens=12, eos_token_ids=[]).sequences


def test_smoke_demo_with_feature_drafters_runs_on_the_device(tmp_path: Path) -> None:
    root_dir = str(tmp_path / "demo")
    distill = (
        f"distill=['experiment=smoke','cache_dir={root_dir}/teacher_cache','drafter.kind=feature',"
        "'train.seq_source=target','train.mixed_precision=auto','train.data_precision=auto']"
    )
    cfg = dataclasses.replace(smoke_config(root_dir, [distill]), device=DEVICE)
    root = run_demo(cfg)
    rows = json.loads((root / "results.json").read_text())["rows"]
    assert {"autoregressive", "generic", "specialized:code", "routed", "oracle"} <= {r["method"] for r in rows}
    greedy = [r for r in rows if r["temperature"] == 0.0]
    assert greedy and all(r["exact_match"] == 1.0 for r in greedy)
    mix, code = (json.loads((root / f"distill-{d}" / "STAGE.json").read_text())["config"] for d in ("mix", "code"))
    assert mix["drafter"]["kind"] == "feature" and code["drafter"]["kind"] == "pretrained"
    assert mix["device"] == code["device"] == DEVICE
    assert isinstance(load_model(root / "distill-code" / "drafter", device=DEVICE)[0], FeatureDrafter)
