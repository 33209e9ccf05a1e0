"""Label prompts for the router: `python router/collect.py` (see conf/collect.yaml), or in seconds on
tiny in-process models: `python router/collect.py --config-name collect_smoke`."""

from specdecode.pipeline.cli import run_hydra_app

if __name__ == "__main__":
    run_hydra_app("collect")
