"""Adapter to vLLM internals (checked against vLLM 0.32.0): does the installed vLLM's class for a
target architecture implement SupportsEagle3, and does it have hidden-state extraction?

Private APIs touched (in a child process, see `_PROBE`):
- `vllm.model_executor.models.ModelRegistry._try_load_model_cls(arch)`: the class without weights.
- the source text of `vllm.config.speculative`, searched for the `extract_hidden_states` method.
- the module path `vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector`.
Public: `ModelRegistry.get_supported_archs()`, `interfaces.supports_eagle3(cls)`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

_PROBE = """
import importlib.util, inspect, json, sys
from vllm.config import speculative
from vllm.model_executor.models import ModelRegistry
from vllm.model_executor.models.interfaces import supports_eagle3
arch = sys.argv[1]
extract = ("extract_hidden_states" in inspect.getsource(speculative) and importlib.util.find_spec(
    "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector") is not None)
if arch not in ModelRegistry.get_supported_archs():
    print(json.dumps({"known": False, "eagle3": False, "cls": None,
                      "extract_hidden_states": extract}))
else:
    cls = ModelRegistry._try_load_model_cls(arch)
    print(json.dumps({"known": True, "eagle3": bool(cls and supports_eagle3(cls)),
                      "cls": cls and f"{cls.__module__}.{cls.__qualname__}",
                      "extract_hidden_states": extract}))
"""
# Bump when _PROBE answers something new, so cached answers are asked again.
_PROBE_VERSION = "3"


def _cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "eagle3-runner" / "vllm-support.json"


def vllm_eagle3_support(architecture: str, version: str) -> dict[str, Any] | None:
    """{known, eagle3, cls, extract_hidden_states} for `architecture` in the installed vLLM
    `version`.

    Asked in a child process (importing vLLM takes ~7 s and sets process-wide state) without
    loading weights, and remembered per vLLM version in the user's cache. None if it could not
    be asked (the plan then reports it as unchecked, not as a failure).
    """
    cache = _cache_file()
    key = f"{version}:{architecture}:{_PROBE_VERSION}"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    try:
        out = subprocess.run(
            [sys.executable, "-c", _PROBE, architecture],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        ).stdout
        answer = json.loads(out.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return None
    known[key] = answer
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, cache)
    except OSError:
        pass
    return answer
