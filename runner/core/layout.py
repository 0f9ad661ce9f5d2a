"""The run's folders, in one place: everything the runner writes lives under one output root.

    layout = RunLayout.at(cfg.run.output_root)      # or RunLayout.at(None): the default root
    layout.store / layout.cache / layout.models / layout.mlflow_db / layout.hydra

The root is `run.output_root` (conf/config.yaml), whose default is $EAGLE3_RUNNER_HOME, else
./outputs; the companion commands (publish, report, gc) take the same default through
`default_root()`. Stages get the layout on their context (`ctx.layout`) and in the plan's view.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# The variable that moves the output root of every command at once.
HOME_ENV = "EAGLE3_RUNNER_HOME"
DEFAULT_ROOT = "outputs"


def default_root() -> str:
    return os.environ.get(HOME_ENV, DEFAULT_ROOT)


@dataclass(frozen=True)
class RunLayout:
    root: Path

    @classmethod
    def at(cls, root: str | os.PathLike[str] | None) -> RunLayout:
        return cls(Path(root if root is not None else default_root()).expanduser().resolve())

    @property
    def store(self) -> Path:
        """Stage artifacts, one folder per stage and key (runner/core/store.py)."""
        return self.root / "store"

    @property
    def scratch(self) -> Path:
        """Work folders of stages in progress (`<stage>-<key>`), which a failed stage resumes."""
        return self.root / "scratch"

    @property
    def cache(self) -> Path:
        """Small facts worth remembering between runs (content hashes, layouts, tokenizers)."""
        return self.root / "cache"

    @property
    def models(self) -> Path:
        """Targets converted or built here (a packaged GGUF, a miniature)."""
        return self.root / "models"

    @property
    def mlflow_db(self) -> Path:
        """The default MLflow store (tracking.uri null and no MLFLOW_TRACKING_URI)."""
        return self.root / "mlflow.db"

    @property
    def mlflow_artifacts(self) -> Path:
        """The default MLflow store's artifact folder (each run's files, under its experiment)."""
        return self.root / "mlartifacts"

    @property
    def hydra(self) -> Path:
        """Hydra's run and multirun folders (conf/config.yaml's hydra.run.dir and sweep.dir)."""
        return self.root / "hydra"


def user_cache() -> Path:
    """This user's cache for the runner, shared by every output root: $XDG_CACHE_HOME or
    ~/.cache, then eagle3-runner/ (vLLM's answers about architectures; the ledger of folders
    being written outside any root, which `runner.commands.gc` reads)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "eagle3-runner"
