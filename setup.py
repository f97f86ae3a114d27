"""Packaging shim; metadata lives in setup.cfg.

`packages` is computed here because setup.cfg's ``find:`` cannot add the
top-level ``cli/`` folder, which is installed as ``actorrpc.cli`` through the
``package_dir`` mapping in setup.cfg (no top-level ``cli`` package is installed).
"""

from setuptools import find_packages, setup

packages = find_packages(include=["actorrpc", "actorrpc.*"], exclude=["actorrpc.cli*"])
packages += ["actorrpc.cli" + name[len("cli"):] for name in find_packages(include=["cli", "cli.*"])]

setup(packages=packages)
