"""The top layer (eval/demo.py): stages cached by their resolved config, and the demo that wires
benchmark → distill → collect → fit → eval through them."""

from specdecode.pipeline.config import DemoConfig
from specdecode.pipeline.demo import run_demo
from specdecode.pipeline.schemas import SCHEMAS, compose_config, register_schemas
from specdecode.pipeline.stages import Stage, run_stages

__all__ = ["SCHEMAS", "DemoConfig", "Stage", "compose_config", "register_schemas", "run_demo", "run_stages"]
