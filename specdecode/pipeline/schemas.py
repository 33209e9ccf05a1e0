"""The apps' structured configs in Hydra's ConfigStore: each conf/<app>.yaml names its schema first in
its defaults list, so a misspelt key or a wrong type fails at composition, naming the key."""

from __future__ import annotations

from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from specdecode.evaluation.config import BenchmarkConfig, EvalConfig
from specdecode.pipeline.config import CONF_DIR, DemoConfig
from specdecode.routing.config import CollectConfig, FitRouterConfig
from specdecode.training.config import TrainJobConfig
from specdecode.watch.watcher import WatchConfig

# ConfigStore name → the dataclass behind the conf/*.yaml files that list it first in their defaults.
SCHEMAS: dict[str, type] = {
    "train_job_schema": TrainJobConfig,  # distill.yaml, finetune.yaml
    "benchmark_schema": BenchmarkConfig,
    "collect_schema": CollectConfig,  # collect.yaml (collect_smoke.yaml extends it)
    "fit_router_schema": FitRouterConfig,  # fit_router.yaml (fit_router_smoke.yaml extends it)
    "eval_schema": EvalConfig,
    "demo_schema": DemoConfig,  # demo.yaml (demo_smoke.yaml extends it)
    "watch_schema": WatchConfig,
}


def register_schemas() -> None:
    """Store every app's schema in Hydra's ConfigStore (idempotent)."""
    store = ConfigStore.instance()
    for name, schema in SCHEMAS.items():
        store.store(name=name, node=schema)


def compose_config(config_name: str, overrides: list[str]) -> dict[str, Any]:
    """The resolved config `python <app>.py <overrides>` would run with."""
    register_schemas()
    if GlobalHydra.instance().is_initialized():
        # Inside a @hydra.main app: carry over the folders the user added with hydra.searchpath.
        added = HydraConfig.get().searchpath if HydraConfig.initialized() else []
        searchpath = [f"hydra.searchpath=[{','.join(added)}]"] if added else []
        cfg = compose(config_name=config_name, overrides=[*searchpath, *overrides])
    else:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=overrides)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(resolved, dict)  # a composed config is a mapping
    resolved.pop("hydra", None)
    return {str(key): value for key, value in resolved.items()}
