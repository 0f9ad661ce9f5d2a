"""Hydra search-path plugin: puts the repository's top-level `sweeps/` folder on Hydra's config
search path, so that a sweep file is selected by name from any working directory:
    python -m runner -m -cn draft_vocab_size
Hydra discovers plugins in the `hydra_plugins` namespace package of the installed project.
"""

from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

SWEEPS = Path(__file__).resolve().parents[2] / "sweeps"


class Eagle3RunnerSweeps(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        # A source checkout's sweeps/, else the copy the wheel installs as `runner.sweeps`.
        where = f"file://{SWEEPS}" if SWEEPS.is_dir() else "pkg://runner.sweeps"
        search_path.append(provider="eagle3-runner-sweeps", path=where)
