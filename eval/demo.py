"""The main job on the embedded default (`make demo`): benchmark, distill, route, evaluate."""

from specdecode.pipeline.cli import run_hydra_app

if __name__ == "__main__":
    run_hydra_app("demo")
