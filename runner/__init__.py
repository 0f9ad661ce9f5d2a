"""EAGLE-3 draft-training runner: `python -m runner` composes conf/ with Hydra and runs the
stages (see runner/__main__.py). Its rooms, each with a docstring saying what it may import:
core, assets, processes, integrations, serving, tracking, engine, commands."""

from pathlib import Path

# The folder that holds the `runner` and `stages` packages (a source checkout's root, or
# site-packages): children put it on PYTHONPATH and run from it.
SOURCE_ROOT = Path(__file__).resolve().parent.parent
