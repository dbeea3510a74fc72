"""Package discovery (every other setting is in pyproject.toml): ``grpo_patches`` and its
sub-packages, and every folder of ``adapters/`` installed as ``grpo_patches.adapters.*``
(pyproject's package-dir maps the folder). A new sub-package or adapter needs no list edited."""
from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["grpo_patches", "grpo_patches.*"]),
                *(f"grpo_patches.{name}" for name in find_packages(include=["adapters", "adapters.*"]))])
