"""Watch speculative decoding work: each token coloured by how it came, tokens/s against the target alone.

python eval/watch.py demo_dir=outputs/demo 'prompts=["Write a Python function that reverses a list."]'
python eval/watch.py demo_dir=outputs/demo                 # type prompts, one a line
python eval/watch.py demo_dir=outputs/demo serve=true      # a local web page that streams the tokens
"""

from specdecode.pipeline.cli import run_hydra_app

if __name__ == "__main__":
    run_hydra_app("watch")
