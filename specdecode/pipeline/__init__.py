"""The top layer (eval/demo.py): stages cached by their resolved config, and the demo that wires
benchmark → distill → collect → fit → eval through them."""

from specdecode.pipeline.demo import DemoConfig, run_demo
from specdecode.pipeline.stages import Stage, run_stages

__all__ = ["DemoConfig", "Stage", "run_demo", "run_stages"]
