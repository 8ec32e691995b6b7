"""Map the four top-level folders onto one import namespace, `icml`.

`cli/` installs as `icml.cli`, `methods/belief_filter/` as `icml.methods.belief_filter`,
and so on; no top-level `cli`, `methods`, `data` or `reports` package is installed.
Everything else about the project is in pyproject.toml.
"""
from setuptools import find_packages, setup

FOLDERS = ("cli", "methods", "data", "reports")

packages = []
for folder in FOLDERS:
    packages.append(f"icml.{folder}")
    packages += [f"icml.{folder}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir={f"icml.{folder}": folder for folder in FOLDERS})
