"""The range checks every config section's `check()` uses (runner/core/schema.py,
runner/core/hardware_settings.py and each stage's settings.py): each raises a ConfigError naming
the key and the range it takes."""

from __future__ import annotations

import math

from runner.core.errors import ConfigError


def at_least(key: str, value: int | float, low: int | float) -> None:
    if value < low:
        raise ConfigError(key, f"{value} must be >= {low}")


# Seeds reach numpy and torch, which take 0..2**32-1.
SEED_MAX = 2**32 - 1


def seed_range(key: str, value: int) -> None:
    if not 0 <= value <= SEED_MAX:
        raise ConfigError(key, f"{value} must be in 0..{SEED_MAX} (numpy's and torch's seed range)")


def finite(key: str, value: float) -> None:
    if not math.isfinite(value):
        raise ConfigError(key, f"{value} must be a finite number")


def path_component(key: str, value: str | None) -> None:
    """A setting the runner uses as one folder name: not empty, no separator, not . or ..."""
    text = (value or "").strip()
    if not text or text in (".", "..") or "/" in text or "\\" in text or "\0" in text:
        raise ConfigError(
            key,
            f"{value!r} is used as a folder name: give one non-empty name without '/' or '\\' "
            "(and not '.' or '..')",
        )


def above(key: str, value: int | float, low: int | float) -> None:
    if value <= low:
        raise ConfigError(key, f"{value} must be > {low}")


def within(key: str, value: float, low: float, high: float) -> None:
    """low <= value < high."""
    if not low <= value < high:
        raise ConfigError(key, f"{value} must be in [{low}, {high})")
