"""A JSON file of answers that took seconds to get (a child process asking vLLM, a tokenizer
loaded to measure), read on each call and rewritten atomically when an answer is added.

    value = remembered(path, key, compute)   # compute() -> (value, keep)

`keep` False: the answer is returned but not stored (it could not be asked, or it is a refusal
that must be found again). An unreadable or unwritable file costs time, never correctness.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def remembered(path: Path, key: str, compute: Callable[[], tuple[Any, bool]]) -> Any:
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    value, keep = compute()
    if keep:
        known[key] = value
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(known, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass
    return value
