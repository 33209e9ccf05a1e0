"""What pyproject.toml cannot say: conf/ ships inside the package as `specdecode/conf`, so the
`specdecode` command finds its configs in an installed wheel (specdecode.core.paths)."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["specdecode", "specdecode.*"]), "specdecode.conf"],
    package_dir={"specdecode.conf": "conf"},
    package_data={"specdecode.conf": ["**/*.yaml"]},
)
