"""Adapter to speculators internals (checked against speculators 0.9.0 and hs-connectors as
installed with it). Everything here patches or subclasses something speculators does not
offer as an extension point; the stages call these and nothing else of its private API.

Private APIs touched:
- `speculators.train.trainer.Trainer.setup_trainer` and its `local_rank` / `device_type`
  attributes, `speculators.train.trainer._StepTimer` and `speculators.train.cli.Trainer`
  (`cpu_training`: the trainer assumes a GPU in three places).
- `speculators.train.cli.setup_metric_logger` and the "speculators.metrics" logger's record
  format (`capture_metrics`: keeps the metric dicts its MLflow logger receives).
- `hs_connectors.transfer.FileBackend` / `FileTransfer.get_cached` and the
  `HiddenStatesBackend.registry` (`register_slot_backend`: read a subset of a file's slots).
- `speculators.train.config.resolution.build_parser` and argparse's `_actions`
  (`negatable_flags`: which train flags take a `--no-` form, so that
  `train.extra_args: {norm_output: false}` can say false).
- the log line "Skipping sample N due to error: ..." of
  `speculators.cli.generate_offline_data` (`SkipRecorder`: names the samples it gave up on).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from runner.tracking import flatten

# The hidden-states backend that reads only some slots, and the variable that says which.
SLOT_BACKEND = "runner-slots"
SLOTS_ENV = "EAGLE3_RUNNER_SLOTS"
# speculators' data-generation client logs each sample it gives up on with this line.
_SKIPPED = re.compile(r"Skipping sample (\d+) due to error: (.*)")
GENERATE_LOGGER = "speculators.cli.generate_offline_data"


@contextmanager
def cpu_training() -> Iterator[None]:
    """Run speculators' trainer on a machine without an accelerator, for one training call.

    The trainer moves the model and batches to `local_rank` (an int, i.e. cuda:0), autocasts on
    `current_accelerator()` (falling back to "cuda"), and its step timer calls
    `torch.accelerator.synchronize()`, which raises on a CPU-only host. This swaps in a Trainer
    subclass and a step timer that fix exactly those. With a GPU present it changes nothing.
    """
    import speculators.train.cli as cli  # speculators imports torch: seconds
    import speculators.train.trainer as trainer_mod
    import torch

    if torch.accelerator.is_available():
        yield
        return

    base_trainer = trainer_mod.Trainer
    base_timer = trainer_mod._StepTimer

    class CPUTrainer(base_trainer):  # type: ignore[misc, valid-type]
        def setup_trainer(self) -> None:
            # Runs after __init__ chose local_rank/device_type and before setup_model uses them.
            self.local_rank = "cpu"
            self.device_type = "cpu"
            super().setup_trainer()

    class CPUStepTimer(base_timer):  # type: ignore[misc, valid-type]
        # Same measurements without the accelerator barrier: CPU work is synchronous.
        def mark(self, name: str) -> None:
            if self.enabled:
                self._marks[name] = time.perf_counter()

        def now(self) -> float | None:
            return time.perf_counter() if self.enabled else None

    cli.Trainer = CPUTrainer
    trainer_mod._StepTimer = CPUStepTimer
    try:
        yield
    finally:
        cli.Trainer = base_trainer
        trainer_mod._StepTimer = base_timer


class MetricCapture(logging.Handler):
    """Keeps speculators' metric records (the dicts its MLflow logger receives), flattened to
    "train/loss"-style keys."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict) and not getattr(record, "hparams", False):
            numbers = {
                k: float(v)
                for k, v in flatten(record.msg, sep="/").items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            self.records.append({"step": getattr(record, "step", None), **numbers})


@contextmanager
def capture_metrics() -> Iterator[MetricCapture]:
    """Collect the metric records of one speculators training call."""
    import speculators.train.cli as cli

    capture = MetricCapture()
    original = cli.setup_metric_logger

    def setup_then_capture(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)  # dictConfig: our handler must come after it
        logging.getLogger("speculators.metrics").addHandler(capture)
        return result

    cli.setup_metric_logger = setup_then_capture
    try:
        yield capture
    finally:
        cli.setup_metric_logger = original
        logging.getLogger("speculators.metrics").removeHandler(capture)


def register_slot_backend() -> None:
    """Register "runner-slots": a hidden-states backend that returns only the slots listed in
    EAGLE3_RUNNER_SLOTS (e.g. "0,2,4") of each file.

    A sweep over capture layers extracts once, capturing the union of the sweep's layers (plus
    the final layer); each job trains on its own. speculators reads every slot of a file
    (`hidden_states[:, :-1]` as the draft's input), so the selection happens in the transfer
    object, which is pickled into DataLoader workers. Use with
    `--hidden-states-backend runner-slots --hidden-states-path <dir>`.
    """
    from hs_connectors import FileTransfer, HiddenStatesBackend
    from hs_connectors.transfer import FileBackend

    if SLOT_BACKEND in HiddenStatesBackend.registry:
        return

    class SlotTransfer(FileTransfer):
        def __init__(self, hidden_states_path: Path, slots: list[int]):
            super().__init__(hidden_states_path)
            self.slots = slots

        def get_cached(self, file_idx: int) -> dict[str, Any] | None:
            sample = super().get_cached(file_idx)
            if sample is not None:
                sample["hidden_states"] = sample["hidden_states"][:, self.slots].contiguous()
            return sample

    @HiddenStatesBackend.register(SLOT_BACKEND)
    class SlotBackend(FileBackend):
        @staticmethod
        def from_train_args(args: argparse.Namespace, data_path: str) -> FileTransfer:
            slots = [int(s) for s in os.environ[SLOTS_ENV].split(",")]
            base = args.hidden_states_path or Path(data_path) / "hidden_states"
            return SlotTransfer(Path(base), slots)

    # Pickling needs the classes findable by name: make them attributes of this module.
    globals().update(SlotTransfer=SlotTransfer, SlotBackend=SlotBackend)
    SlotTransfer.__qualname__ = "SlotTransfer"
    SlotBackend.__qualname__ = "SlotBackend"


@functools.cache
def negatable_flags() -> frozenset[str]:
    """speculators train flags that also take a `--no-` form (argparse BooleanOptionalAction),
    e.g. "--norm-output"; a flag without one is store_true, false by default."""
    from speculators.train.config.resolution import build_parser  # imports torch: seconds

    return frozenset(
        opt
        for action in build_parser()._actions
        if isinstance(action, argparse.BooleanOptionalAction)
        for opt in action.option_strings
        if not opt.startswith("--no-")
    )


class SkipRecorder(logging.Handler):
    """Collects the samples speculators' data-generation client gave up on, with its reason."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.failed: dict[int, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        m = _SKIPPED.match(record.getMessage())
        if m:
            self.failed[int(m.group(1))] = m.group(2)


@contextmanager
def recording_skips() -> Iterator[SkipRecorder]:
    rec = SkipRecorder()
    logger = logging.getLogger(GENERATE_LOGGER)
    logger.addHandler(rec)
    try:
        yield rec
    finally:
        logger.removeHandler(rec)
