"""EAGLE-3 draft-training runner: `python -m runner` composes conf/ with Hydra and runs the
stages (see runner/__main__.py)."""
