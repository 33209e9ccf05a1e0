"""Every YAML under conf/ composes, and bad values are named."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from specdecode.core.config import from_dict
from specdecode.evaluation.config import BenchmarkConfig
from specdecode.models.config import DrafterConfig, TargetConfig

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.mark.parametrize("target", sorted(p.stem for p in (CONF / "target").glob("*.yaml")))
@pytest.mark.parametrize("drafter", sorted(p.stem for p in (CONF / "drafter").glob("*.yaml")))
def test_benchmark_config_composes(target, drafter) -> None:
    overrides = [f"target={target}", f"drafter={drafter}"]
    if drafter == "pretrained":
        overrides.append("drafter.path=some/drafter")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="benchmark", overrides=overrides)
    built = from_dict(BenchmarkConfig, OmegaConf.to_container(cfg, resolve=True))
    assert built.drafter.kind == OmegaConf.load(CONF / "drafter" / f"{drafter}.yaml").kind


@pytest.mark.parametrize(
    "build, needle",
    [
        (lambda: BenchmarkConfig(gamma=0), "gamma=0"),
        (lambda: BenchmarkConfig(batch_size=20), "batch_size=20"),
        (lambda: BenchmarkConfig(gamma=100_000), r"gamma=100000: an int in \[1, 64\]"),
        (lambda: BenchmarkConfig(temperature=float("inf")), "temperature=inf"),
        (lambda: BenchmarkConfig(dtype="float33"), "dtype='float33'"),
        (lambda: BenchmarkConfig(device="tpu:0"), "device='tpu:0': expected cpu, cuda, cuda:N or mps"),
        (lambda: TargetConfig(name=""), "target.name"),
        (lambda: DrafterConfig(kind="magic"), "magic"),
        (lambda: DrafterConfig(kind="pretrained"), "drafter.path"),
        (lambda: DrafterConfig(draft_vocab=0), "draft_vocab=0"),
        (lambda: DrafterConfig(path="some/drafter"), r"drafter.path='some/drafter': is set but drafter.kind='derived'"),
        (lambda: DrafterConfig(kind="pretrained", path="some/drafter", draft_vocab=96), r"drafter.draft_vocab=96: is set but drafter.kind='pretrained'"),
        (lambda: from_dict(BenchmarkConfig, {"gama": 3}), "gama"),
        (lambda: from_dict(BenchmarkConfig, {"drafter": {"layers": 3}}), "drafter.layers"),
    ],
)
def test_bad_config_names_the_field(build, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        build()
