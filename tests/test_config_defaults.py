"""Each default in one place: a value that an app's conf/<app>.yaml sets is its schema dataclass's
default, so the YAML (what the app runs with) and the dataclass (what the library gets) never tell
two stories.

The rule: every key a top-level app YAML (one that names a `*_schema` first in its defaults) sets
equals the default of its field in that schema, key by key inside nested dataclasses, except the
keys listed in `NOT_DEFAULTS` with the reason why the YAML holds a value no default can. The
`*_smoke.yaml` files and the config groups (conf/target/, conf/router/, ...) are variants chosen
on purpose, not defaults, and are not compared.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from specdecode.pipeline.schemas import SCHEMAS

CONF = Path(__file__).resolve().parents[1] / "conf"

# (file, dotted key) → why the YAML's value is not the schema's default.
NOT_DEFAULTS: dict[tuple[str, str], str] = {
    (
        "distill.yaml",
        "output_dir",
    ): "an interpolation of the data and loss names, which a dataclass default cannot resolve",
    ("finetune.yaml", "name"): "TrainJobConfig serves two apps; its defaults are distill.yaml's",
    ("finetune.yaml", "train.seq_source"): "TrainJobConfig serves two apps; its defaults are distill.yaml's",
    ("finetune.yaml", "train.seq_temperatures"): "TrainJobConfig serves two apps; its defaults are distill.yaml's",
    ("collect.yaml", "drafters"): "the trained drafter folders to label: the app's input, which no default can name",
    ("demo.yaml", "skinny_matmul"): "the demo measures the CPU kernel (opt-in for the apps and the library)",
    **{
        ("demo.yaml", key): "the demo's overrides of a stage's own YAML, none by default"
        for key in ("losses", "benchmark", "distill", "distill_per_domain", "collect", "eval")
    },
}


# The training apps' YAML sets only what differs from the dataclass: every key they set is listed in
# NOT_DEFAULTS (finetune.yaml composes distill.yaml, so each training default lives in TrainJobConfig).
ONLY_DIFFERENCES = ("distill.yaml", "finetune.yaml")


def app_yamls() -> dict[str, type]:
    """conf/<app>.yaml → the schema dataclass it names first in its defaults list, or that of the
    app YAML it composes (finetune.yaml's `- distill`)."""
    found = {}
    for path in sorted(CONF.glob("*.yaml")):
        defaults = OmegaConf.to_container(OmegaConf.load(path)).get("defaults", [])
        schema = next((d for d in defaults if isinstance(d, str) and d.endswith("_schema")), None)
        if schema is not None:
            found[path.name] = SCHEMAS[schema]
    for path in sorted(CONF.glob("*.yaml")):
        defaults = OmegaConf.to_container(OmegaConf.load(path)).get("defaults", [])
        base = next((f"{d}.yaml" for d in defaults if isinstance(d, str) and f"{d}.yaml" in found), None)
        if base is not None and path.name in ONLY_DIFFERENCES and path.name not in found:
            found[path.name] = found[base]
    return found


def keys_of(values: dict[str, Any], prefix: str = "") -> set[str]:
    """The dotted keys of the leaves of `values`."""
    found = set()
    for key, value in values.items():
        found |= keys_of(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key}
    return found


def defaults_of(schema: object) -> dict[str, Any]:
    """Field name → default: a schema's field defaults, or a nested default instance's values."""
    if not isinstance(schema, type):
        return {f.name: getattr(schema, f.name) for f in dataclasses.fields(schema)}
    defaults = {}
    for field in dataclasses.fields(schema):
        factory = field.default_factory
        defaults[field.name] = field.default if factory is dataclasses.MISSING else factory()
    return defaults


def disagreements(defaults: dict[str, Any], values: dict[str, Any], prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """dotted key → (the default, the YAML's value), for every key of `values` that differs, key by
    key inside nested dataclasses."""
    found = {}
    for key, value in values.items():
        if key not in defaults:
            found[prefix + key] = ("no such field", value)
            continue
        default = defaults[key]
        if isinstance(value, dict) and dataclasses.is_dataclass(default):
            found |= disagreements(defaults_of(default), value, f"{prefix}{key}.")
            continue
        if dataclasses.is_dataclass(default):
            default = dataclasses.asdict(default)
        if default != value:
            found[prefix + key] = (default, value)
    return found


def app_values(name: str) -> dict[str, Any]:
    """What conf/<name> sets itself: its keys less the defaults list and Hydra's own settings."""
    values = OmegaConf.to_container(OmegaConf.load(CONF / name), resolve=False)
    values.pop("defaults", None)
    values.pop("hydra", None)  # no schema field
    return values


@pytest.mark.parametrize("name", sorted(app_yamls()))
def test_every_value_an_app_yaml_sets_is_its_schemas_default(name: str) -> None:
    found = disagreements(defaults_of(app_yamls()[name]), app_values(name))
    unexplained = {key: pair for key, pair in found.items() if (name, key) not in NOT_DEFAULTS}
    assert not unexplained, f"{name}: (dataclass default, YAML value) disagree for {unexplained}: make them equal"


@pytest.mark.parametrize("name", ONLY_DIFFERENCES)
def test_the_training_yamls_set_only_what_differs_from_the_dataclass(name: str) -> None:
    assert name in app_yamls(), f"{name} names no schema, nor composes an app YAML that does"
    same = {key for key in keys_of(app_values(name)) if (name, key) not in NOT_DEFAULTS}
    assert not same, f"{name} repeats dataclass defaults {sorted(same)}: drop them (each default lives in one place)"


def test_finetune_composes_distill() -> None:
    defaults = OmegaConf.to_container(OmegaConf.load(CONF / "finetune.yaml"))["defaults"]
    assert "distill" in defaults


def test_every_listed_exception_still_disagrees() -> None:
    """An entry of NOT_DEFAULTS whose values have come to agree is dropped, so the list stays true."""
    found = set()
    for name, schema in app_yamls().items():
        found |= {(name, key) for key in disagreements(defaults_of(schema), app_values(name))}
    assert set(NOT_DEFAULTS) <= found, f"no longer disagree: {sorted(set(NOT_DEFAULTS) - found)}"
