"""Nested mappings as MLflow wants them: flat keys for params ("a.b") and metrics ("a/b")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def flatten(d: Mapping[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1} (MLflow params) or, with sep="/", {"a/b": 1} (metrics)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + sep, sep))
        else:
            out[key] = v
    return out
