"""One console: the runner's own lines in one format; the libraries' lines go to the job's log.

Hydra's job logging (conf/hydra/job_logging/runner.yaml) gives the console and the job's log file
(`<output_root>/hydra/<time>/runner.log`) one format and puts `LibraryFilter` on the console:
the libraries' records (transformers, datasets, speculators, MLflow, Python warnings) reach the
console only when they are errors; their warnings are counted by source, and the run's summary
says how many there were and where they are (`library_note`). `quiet_libraries()` routes the
rest of what they print on their own into the same place: Python warnings and speculators'
loguru records into logging, and the progress bars of transformers and datasets off (the
runner's stages keep their own; speculators' epoch bar gives way to the runner's progress line,
runner/integrations/speculators.py). vLLM's server output is handled where the server runs
(runner/serving/vllm_server.py), in the same way.
"""

from __future__ import annotations

import collections
import logging
import os
from typing import Any

from runner.integrations.speculators_metrics import ECHO_STEPS_ENV

# Libraries whose lines are the runner's interface: Hydra's (a sweep's job list, "#1 : ...").
_SHOWN = ("hydra",)
# Source -> warnings kept off the console in this process (a sweep's jobs add up; each job's
# summary reports what it added).
WARNINGS: collections.Counter[str] = collections.Counter()


def _source(record: logging.LogRecord) -> str:
    if record.name == "py.warnings":
        return "python warnings"
    return record.name.split(".")[0]


class LibraryFilter(logging.Filter):
    """On the console handler of the root logger (the libraries'; the runner's logger has its
    own): errors pass, warnings are counted, the rest stays in the log file."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or record.name.startswith(_SHOWN):
            return True
        if record.name == "speculators.metrics":  # per-step records, asked for by echo_steps
            return os.environ.get(ECHO_STEPS_ENV) == "1"
        if record.levelno >= logging.WARNING:
            WARNINGS[_source(record)] += 1
        return False


def _loguru_to_logging(message: Any) -> None:
    r = message.record
    logging.getLogger(r["name"] or "loguru").log(r["level"].no, r["message"])


def quiet_libraries() -> None:
    """What the libraries print on their own goes through logging (so through the filter above),
    and the progress bars of transformers, huggingface_hub and datasets are off (read from the
    environment when they are imported or draw). Only under Hydra's job logging, where the
    console filter is in place; idempotent."""
    if not any(
        any(isinstance(f, LibraryFilter) for f in h.filters) for h in logging.getLogger().handlers
    ):
        return
    logging.captureWarnings(True)
    # MLflow's own handler prints its database set-up in a format of its own.
    os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    try:
        from loguru import logger  # speculators logs its model loading through loguru

        logger.remove()
        logger.add(_loguru_to_logging, level="INFO", format="{message}")
    except ImportError:
        pass


def bar_interval() -> float:
    """Seconds between a stage's progress-bar redraws: tqdm's own on a terminal; in a log file or
    a pipe, where every redraw is a line, one every 15 s."""
    import sys

    return 0.1 if sys.stderr.isatty() else 15.0


def counted() -> dict[str, int]:
    return dict(WARNINGS)


def library_note(before: dict[str, int], log_files: list[str]) -> str | None:
    """'library warnings: 3 (python warnings 2, speculators 1), in <log file>' for what was
    counted since `before`; None if nothing was."""
    now = {k: v - before.get(k, 0) for k, v in WARNINGS.items() if v > before.get(k, 0)}
    if not now:
        return None
    parts = ", ".join(f"{k} {v}" for k, v in sorted(now.items(), key=lambda kv: -kv[1]))
    where = f", in {log_files[0]}" if log_files else ""
    return f"library warnings not shown: {sum(now.values())} ({parts}){where}"
