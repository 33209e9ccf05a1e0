"""Acceptance, tau, speedup and exact match per domain and method.

python eval/acceptance.py +drafters.generic=... +drafters.code=... router_dir=...
accelerate launch eval/acceptance.py ...          # prompts split across processes
python eval/acceptance.py -m gamma=1,2,3,4,6,8    # gamma ablation (Hydra multirun)
"""

from specdecode.pipeline.cli import run_hydra_app

if __name__ == "__main__":
    run_hydra_app("eval")
