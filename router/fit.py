"""Fit the router on collected labels and report on held-out prompts: `python router/fit.py`
(see conf/fit_router.yaml), or the smoke run: `python router/fit.py --config-name fit_router_smoke`."""

from specdecode.pipeline.cli import run_hydra_app

if __name__ == "__main__":
    run_hydra_app("fit")
