"""The one device / dtype knob: checked once, up front, and carried to every stage."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from specdecode.core.config import from_dict
from specdecode.core.devices import check_device_name, placed_accelerator, resolve_device, resolve_mixed_precision
from specdecode.evaluation.config import EvalConfig
from specdecode.evaluation.suite import run_eval
from specdecode.models.config import TargetConfig
from specdecode.pipeline.config import CONF_DIR, DemoConfig
from specdecode.pipeline.demo import demo_stages, run_demo
from specdecode.routing.config import CollectConfig, FitRouterConfig
from specdecode.training.config import TrainJobConfig
from specdecode.training.job import run_distill
from tests.test_demo import smoke_config
from tests.test_train import smoke_cfg

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
MISSING_GPU = r"device='cuda:1': this machine has 0 CUDA device\(s\)"


@pytest.mark.parametrize("name", ["cpu", "cuda", "cuda:0", "cuda:12", "mps", " cpu "])
def test_device_names_accepted(name: str) -> None:
    assert check_device_name(name) == name.strip()


@pytest.mark.parametrize("name", ["tpu:0", "cuda:", "cuda:x", "gpu", "", 3, None, "cpu:0:1"])
def test_bad_device_names_are_named(name: object) -> None:
    with pytest.raises(
        ValueError, match=rf"device={name!r}: expected cpu, cuda, cuda:N or mps".replace("(", r"\(").replace(")", r"\)")
    ):
        check_device_name(name)


@pytest.mark.parametrize(
    ("amx", "avx512", "expected"),
    [(True, True, "bf16"), (False, True, "bf16"), (True, False, "bf16"), (False, False, "no")],
)
def test_auto_mixed_precision_is_bf16_only_where_the_cpu_computes_it(
    monkeypatch: pytest.MonkeyPatch, amx: bool, avx512: bool, expected: str
) -> None:
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"amx_bf16": amx, "avx512_bf16": avx512, "avx2": True})
    assert resolve_mixed_precision("auto", torch.device("cpu")) == expected
    assert [resolve_mixed_precision(s, torch.device("cpu")) for s in ("no", "bf16", "fp16")] == ["no", "bf16", "fp16"]
    with pytest.raises(ValueError, match=r"mixed_precision='fp8': expected auto\|no\|bf16\|fp16"):
        resolve_mixed_precision("fp8", torch.device("cpu"))


@pytest.mark.parametrize("app", ["benchmark", "distill", "finetune", "collect", "fit_router", "eval", "demo"])
def test_every_app_has_one_top_level_knob(app: str) -> None:
    """device / dtype sit at the top of each app's config and nowhere else (no target.device)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = OmegaConf.to_container(
            compose(config_name=app, overrides=["device=cuda:1", "dtype=bfloat16"]), resolve=True
        )
    assert (cfg["device"], cfg["dtype"]) == ("cuda:1", "bfloat16")
    assert "device" not in cfg.get("target", {}) and "dtype" not in cfg.get("target", {})
    assert "device" not in cfg.get("router", {}).get("embedder", {})


@no_cuda
def test_a_device_this_machine_lacks_fails_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=MISSING_GPU):
        resolve_device("cuda:1")
    with pytest.raises(ValueError, match=MISSING_GPU):
        placed_accelerator("cuda:1")
    out = tmp_path / "eval"
    with pytest.raises(ValueError, match=MISSING_GPU):
        run_eval(
            EvalConfig(
                device="cuda:1",
                target=TargetConfig(name="smoke"),
                methods=["autoregressive"],
                synthetic=True,
                output_dir=str(out),
            )
        )
    assert not (out / "results.json").exists()
    with pytest.raises(ValueError, match=MISSING_GPU):
        run_distill(smoke_cfg(tmp_path, "device=cuda:1"))
    assert not (tmp_path / "cache").exists()  # no teacher pass was paid
    demo = dataclasses.replace(smoke_config(str(tmp_path / "demo")), device="cuda:1")
    with pytest.raises(ValueError, match=MISSING_GPU):
        run_demo(demo)
    assert not list((tmp_path / "demo").rglob("*"))  # no stage ran (the lock is gone too)


def test_demo_carries_device_dtype_and_eval_gamma_to_every_stage(tmp_path: Path) -> None:
    cfg = dataclasses.replace(smoke_config(str(tmp_path / "demo")), device="cuda:1", dtype="bfloat16")
    stages = {stage.name: stage.config for stage in demo_stages(cfg)}
    assert {(c["device"], c["dtype"]) for c in stages.values()} == {("cuda:1", "bfloat16")}
    # gamma is declared once: the router's labels describe the gamma the evaluation runs at.
    assert stages["collect"]["gamma"] == stages["eval"]["gamma"] == 2
    # Every stage's schema accepts the placement (no stage silently drops it).
    for name, schema in (("distill-code", TrainJobConfig), ("collect", CollectConfig), ("fit", FitRouterConfig)):
        assert from_dict(schema, dict(stages[name])).device == "cuda:1"
    assert from_dict(EvalConfig, stages["eval"] | {"drafters": {}, "methods": ["autoregressive"]}).device == "cuda:1"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_index_is_honoured() -> None:
    index = torch.cuda.device_count() - 1
    accelerator, device = placed_accelerator(f"cuda:{index}")
    assert device == torch.device("cuda", index) and torch.cuda.current_device() == index
    assert torch.zeros(1, device=accelerator.device).device.index == index


def test_the_demo_declares_gamma_once() -> None:
    """conf/demo.yaml: the evaluation chooses each step's gamma (auto), beside a sweep of fixed
    ones; the benchmark and the router's labels then keep their own, as for null; an int there
    reaches both. Sampled rows beside greedy."""

    def stages(overrides: list[str]) -> dict[str, dict]:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            resolved = OmegaConf.to_container(compose(config_name="demo", overrides=overrides), resolve=True)
        resolved.pop("hydra", None)
        return {stage.name: stage.config for stage in demo_stages(from_dict(DemoConfig, resolved))}

    demo = stages([])
    assert demo["eval"]["gamma"] == "auto" and "eval-short" not in demo
    assert demo["collect"]["gamma"] is None and demo["benchmark"]["gamma"] == 4
    assert max(demo["eval"]["temperatures"]) > 0 and demo["eval"]["sweep_gammas"]
    assert stages(["short_eval=['max_new_tokens=32']"])["eval-short"]["gamma"] == "auto"
    fixed = stages(["eval=['gamma=3']", "short_eval=['max_new_tokens=32']"])
    assert {fixed[name]["gamma"] for name in ("benchmark", "collect", "eval", "eval-short")} == {3}
    stored = stages(["eval=['gamma=null']"])
    assert stored["eval"]["gamma"] is None and stored["collect"]["gamma"] is None
    assert stored["benchmark"]["gamma"] == 4  # the benchmark's own default


@pytest.mark.parametrize("app", ["benchmark", "distill", "finetune", "collect", "eval", "demo"])
def test_skinny_matmul_is_a_top_level_knob(app: str) -> None:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = OmegaConf.to_container(compose(config_name=app, overrides=["skinny_matmul=false"]), resolve=True)
    assert cfg["skinny_matmul"] is False


def test_skinny_matmul_reaches_every_demo_stage(tmp_path: Path) -> None:
    cfg = dataclasses.replace(smoke_config(str(tmp_path / "demo")), skinny_matmul=False)
    assert {stage.config["skinny_matmul"] for stage in demo_stages(cfg)} == {False}


@pytest.mark.parametrize("value", ["yes", 1, "auto"])
def test_bad_skinny_matmul_is_named(value: object) -> None:
    with pytest.raises(ValueError, match=rf"skinny_matmul={value!r}: true, false or null"):
        EvalConfig(skinny_matmul=value, methods=["autoregressive"])  # type: ignore[arg-type]
