"""Every YAML under conf/ composes, and bad values are named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from specdecode.core.config import from_dict, require_ints
from specdecode.evaluation.config import BenchmarkConfig
from specdecode.models.config import DrafterConfig, TargetConfig
from specdecode.pipeline.schemas import SCHEMAS

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
        (
            lambda: from_dict(BenchmarkConfig, {"prompt_lookup": {"min_ngram": 0}}),
            "min_ngram must be an int >= 1, got 0",
        ),
        (lambda: BenchmarkConfig(device="tpu:0"), "device='tpu:0': expected cpu, cuda, cuda:N or mps"),
        (lambda: TargetConfig(name=""), "target.name"),
        (lambda: DrafterConfig(kind="magic"), "magic"),
        (lambda: DrafterConfig(kind="pretrained"), "drafter.path"),
        (lambda: DrafterConfig(draft_vocab=0), "draft_vocab=0"),
        (lambda: DrafterConfig(path="some/drafter"), r"drafter.path='some/drafter': is set but drafter.kind='derived'"),
        (
            lambda: DrafterConfig(kind="pretrained", path="some/drafter", draft_vocab=96),
            r"drafter.draft_vocab=96: is set but drafter.kind='pretrained'",
        ),
        (lambda: from_dict(BenchmarkConfig, {"gama": 3}), "gama"),
        (lambda: from_dict(BenchmarkConfig, {"drafter": {"layers": 3}}), "drafter.layers"),
    ],
)
def test_bad_config_names_the_field(build, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        build()


# Every app's YAML and the dataclass Hydra composes it onto (its ConfigStore schema).
APP_SCHEMAS = {
    "distill": "TrainJobConfig",
    "finetune": "TrainJobConfig",
    "benchmark": "BenchmarkConfig",
    "collect": "CollectConfig",
    "collect_smoke": "CollectConfig",
    "fit_router": "FitRouterConfig",
    "fit_router_smoke": "FitRouterConfig",
    "eval": "EvalConfig",
    "demo": "DemoConfig",
    "demo_smoke": "DemoConfig",
    "watch": "WatchConfig",
}


def test_every_app_config_has_a_registered_schema() -> None:
    assert {p.stem for p in CONF.glob("*.yaml")} == set(APP_SCHEMAS)
    assert {cls.__name__ for cls in SCHEMAS.values()} == set(APP_SCHEMAS.values())


@pytest.mark.parametrize("app", sorted(APP_SCHEMAS))
def test_app_config_composes_onto_its_schema(app: str) -> None:
    """The composed config is typed by its dataclass (not a plain dict), and `to_object` builds it."""
    overrides = ["methods=[autoregressive]"] if app == "eval" else []  # the others need trained folders
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name=app, overrides=overrides)
    assert OmegaConf.get_type(cfg).__name__ == APP_SCHEMAS[app]
    built = OmegaConf.to_object(cfg)
    assert type(built).__name__ == APP_SCHEMAS[app]


@pytest.mark.parametrize(
    "override, needle",
    [
        ("gama=3", r"Key 'gama' not in 'BenchmarkConfig'"),  # a typo is not a new key
        ("drafter.layers=3", r"Key 'layers' not in 'DrafterConfig'"),
        ("gamma=three", r"Value 'three' of type 'str' could not be converted to Integer"),
        ("skinny_matmul=maybe", r"Value 'maybe' is not a valid bool"),
        ("temperature=[1]", r"temperature"),
    ],
)
def test_composition_rejects_unknown_keys_and_wrong_types(override: str, needle: str) -> None:
    """The schema closes the YAML: Hydra refuses these at composition, before any stage runs."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        with pytest.raises(ConfigCompositionException) as caught:
            compose(config_name="benchmark", overrides=[override])
    # Hydra prints the cause (OmegaConf's error naming the key) under its own line.
    assert re.search(needle, str(caught.value.__cause__)), caught.value.__cause__


def test_from_dict_converts_to_the_field_types_and_names_bad_keys() -> None:
    built = from_dict(BenchmarkConfig, {"gamma": "3", "temperature": 1, "drafter": {"num_layers": "4"}})
    assert (built.gamma, built.temperature, built.drafter.num_layers) == (3, 1.0, 4)
    assert isinstance(built.drafter, DrafterConfig) and isinstance(built.temperature, float)
    with pytest.raises(
        ValueError,
        match=r"^drafter\.layers: Key 'layers' not in 'DrafterConfig'; known: \['draft_vocab', 'feature_layers', "
        r"'init_from_layer', 'kind', 'layout', 'num_layers', 'path', 'revision', 'trust_remote_code'\]",
    ):
        from_dict(BenchmarkConfig, {"drafter": {"layers": 3}})
    with pytest.raises(ValueError, match=r"^gamma: Value 'x' of type 'str' could not be converted to Integer"):
        from_dict(BenchmarkConfig, {"gamma": "x"})
    with pytest.raises(ValueError, match=r"^gamma=0: an int in \[1, 64\]"):  # __post_init__ still runs
        from_dict(BenchmarkConfig, {"gamma": 0})


def test_distillation_defaults_to_the_targets_continuations_and_smoke_to_the_data() -> None:
    """The measured default: the target's greedy and T = 0.7 continuations; the smoke experiment
    keeps the dataset's responses so tests generate nothing."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        default = OmegaConf.to_object(compose(config_name="distill"))
        smoke = OmegaConf.to_object(compose(config_name="distill", overrides=["experiment=smoke"]))
    assert (default.train.seq_source, default.train.seq_temperatures) == ("target", [0.0, 0.7])
    assert (smoke.train.seq_source, smoke.train.seq_temperatures) == ("data", None)


@pytest.mark.parametrize("app", ["distill", "finetune"])
def test_the_gpu_experiment_composes_onto_the_training_jobs(app: str) -> None:
    """conf/experiment/gpu.yaml (the H100 recipe) is closed by the schema and picks the feature
    drafter; the command line still wins over it."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        gpu = OmegaConf.to_object(compose(config_name=app, overrides=["experiment=gpu"]))
        moved = OmegaConf.to_object(
            compose(config_name=app, overrides=["experiment=gpu", "device=cuda:1", "train.max_minutes=5"])
        )
    assert (gpu.device, gpu.drafter.kind, gpu.train.generation_batch, gpu.train.gamma_candidates) == (
        "cuda",
        "feature",
        256,
        [4],
    )
    assert (moved.device, moved.train.max_minutes) == ("cuda:1", 5.0)


def test_require_ints_names_the_field_and_what_it_should_be() -> None:
    class Counts:
        steps, limit = 3, None

    require_ints(Counts(), "steps limit", nullable=True)
    with pytest.raises(ValueError, match=r"^limit=None: an int >= 1$"):
        require_ints(Counts(), "steps limit")
    with pytest.raises(ValueError, match=r"^router\.steps=3: null or an int >= 4$"):
        require_ints(Counts(), "steps", 4, nullable=True, prefix="router.")
    Counts.steps = True  # YAML's `true` is no int
    with pytest.raises(ValueError, match=r"^steps=True: an int >= 0$"):
        require_ints(Counts(), "steps", 0)
