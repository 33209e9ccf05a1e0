"""Where the apps' configs live: `conf/` beside the package in a checkout, `specdecode/conf/` in an
installed wheel (setup.py ships the checkout's conf/ there)."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]


def _conf_dir() -> Path:
    shipped = _PACKAGE / "conf"
    return shipped if shipped.is_dir() else _PACKAGE.parent / "conf"


CONF_DIR = _conf_dir()
"""The folder holding the apps' Hydra configs (demo.yaml, distill.yaml, data/, ...)."""
