"""Acceptance, tau, speedup and exact match per domain and method.

python eval/acceptance.py +drafters.generic=... +drafters.code=... router_dir=...
accelerate launch eval/acceptance.py ...          # prompts split across processes
python eval/acceptance.py -m gamma=1,2,3,4,6,8    # gamma ablation (Hydra multirun)
"""

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from specdecode.evaluation.suite import run_eval
from specdecode.pipeline.schemas import register_schemas

# conf/*.yaml list their schema (the dataclass) first; Hydra finds it in the ConfigStore.
register_schemas()


@hydra.main(version_base="1.3", config_path="../conf", config_name="eval")
def main(cfg: DictConfig) -> None:
    if HydraConfig.get().mode.name == "MULTIRUN":
        # Each sweep job writes into its own folder (the sweep's subdir).
        cfg.output_dir = HydraConfig.get().runtime.output_dir
    run_eval(OmegaConf.to_object(cfg))


if __name__ == "__main__":
    main()
