"""Where the apps' configs live: `conf/` beside the package in a checkout, `specdecode/conf/` in an
installed wheel (setup.py ships the checkout's conf/ there)."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]
CONF_DIR = _PACKAGE / "conf" if (_PACKAGE / "conf").is_dir() else _PACKAGE.parent / "conf"
"""The folder holding the apps' Hydra configs (demo.yaml, distill.yaml, data/, ...)."""
