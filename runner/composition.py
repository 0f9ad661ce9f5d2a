"""The composition root: the one module that names the stages (stages/__init__.py's registry) and
hands them to the engine, which imports no stage itself. The entry point (runner/__main__.py)
and the companion commands that need the schema (`ls`) call `compose_root()` from here; nothing
below runner/ imports it.
"""

from __future__ import annotations

import sys

from omegaconf import OmegaConf

from runner.core.schema import register
from runner.engine.costs import use_stage_rates
from runner.engine.stage import Stage
from runner.integrations.hydra_plugins import expose
from stages import REGISTRY


def compose_root() -> tuple[Stage, ...]:
    """The composition root's one act, called before Hydra composes anything: the registry's
    schema (RunnerConfig plus the sections of stages with settings) becomes Hydra's base config,
    and the resolver a Slurm job's setup uses is registered. Idempotent; returns the registry.
    Nothing is registered by importing a module."""
    register(REGISTRY)
    use_stage_rates(REGISTRY)  # each stage's rates.yaml joins the plan's table of rates
    expose()  # sweeps/ on Hydra's search path from any folder, editable installs included
    # The environment `python -m runner` runs in: a Slurm job's setup activates the same one
    # (conf/hydra/launcher/slurm.yaml).
    if not OmegaConf.has_resolver("runner_python_prefix"):
        OmegaConf.register_new_resolver("runner_python_prefix", lambda: sys.prefix)
    # `--help` lists the stages as the registry has them.
    if not OmegaConf.has_resolver("runner_stages"):
        OmegaConf.register_new_resolver(
            "runner_stages",
            lambda: ", ".join(f"{s.name}{' (optional)' if s.enabled else ''}" for s in REGISTRY),
        )
    return REGISTRY
