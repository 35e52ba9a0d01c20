"""The packages a build installs; everything else is in pyproject.toml.

Every package under batchfix/ is found, so a new subpackage cannot be left out of a wheel. The two that
[tool.setuptools.package-dir] maps from other folders (batchfix.conf from conf/, batchfix.bundled from data/)
are named here: a search of batchfix/ cannot see them, and pyproject.toml takes either a list or a search.
"""
from setuptools import find_packages, setup

MAPPED_PACKAGES = ["batchfix.conf", "batchfix.bundled"]

setup(packages=find_packages(include=["batchfix", "batchfix.*"]) + MAPPED_PACKAGES)
