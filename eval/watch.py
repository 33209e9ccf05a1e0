"""Watch speculative decoding work: each token coloured by how it came, tokens/s against the target alone.

python eval/watch.py demo_dir=outputs/demo 'prompts=["Write a Python function that reverses a list."]'
python eval/watch.py demo_dir=outputs/demo                 # type prompts, one a line
python eval/watch.py demo_dir=outputs/demo serve=true      # a local web page that streams the tokens
"""

import hydra
from omegaconf import DictConfig, OmegaConf

from specdecode.pipeline.schemas import register_schemas
from specdecode.watch.terminal import run_watch

# conf/*.yaml list their schema (the dataclass) first; Hydra finds it in the ConfigStore.
register_schemas()


@hydra.main(version_base="1.3", config_path="../conf", config_name="watch")
def main(cfg: DictConfig) -> None:
    run_watch(OmegaConf.to_object(cfg))


if __name__ == "__main__":
    main()
