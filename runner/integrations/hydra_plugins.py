"""Adapter to Hydra's plugin discovery (checked against hydra-core 1.3.2 and setuptools' editable
installs): the runner's search-path plugin (hydra_plugins/eagle3_runner_sweeps, which puts
sweeps/ on Hydra's search path) is found from any folder.

Hydra finds plugins by listing the modules of the `hydra_plugins` namespace package with
pkgutil. An editable install (`pip install -e .`, what `make setup` does) serves the runner's
plugin through an import hook that pkgutil cannot list, so outside the source tree `-cn
<sweep>` found no sweep. `expose()` adds the plugin's folder to the namespace's path before
Hydra scans it; a regular install, where the plugin lies in site-packages, needs nothing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PLUGIN = "hydra_plugins.eagle3_runner_sweeps"


def expose() -> None:
    import hydra_plugins

    spec = importlib.util.find_spec(PLUGIN)
    if spec is None or not spec.submodule_search_locations:
        return
    folder = str(Path(next(iter(spec.submodule_search_locations))).parent)
    if folder not in list(hydra_plugins.__path__):
        hydra_plugins.__path__.append(folder)
