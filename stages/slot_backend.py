"""Adapter: let speculators' trainer read a subset of the slots of shared hidden-state files.

A sweep over capture layers extracts once, capturing the union of the sweep's layers (plus the
final layer); each job then trains on its own layers. speculators reads every slot of a file
(`hidden_states[:, :-1]` as the draft's input), so this registers a hidden-states backend,
"runner-slots", whose transfer returns only the selected slots. The selection travels in the
transfer object itself (pickled into DataLoader workers), read once from EAGLE3_RUNNER_SLOTS.

Usage (stages.train): set EAGLE3_RUNNER_SLOTS="0,2,4" and pass
`--hidden-states-backend runner-slots --hidden-states-path <dir>` to speculators.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from hs_connectors import FileTransfer, HiddenStatesBackend
from hs_connectors.transfer import FileBackend

NAME = "runner-slots"
ENV = "EAGLE3_RUNNER_SLOTS"


class SlotTransfer(FileTransfer):
    def __init__(self, hidden_states_path: Path, slots: list[int]):
        super().__init__(hidden_states_path)
        self.slots = slots

    def get_cached(self, file_idx: int) -> dict[str, Any] | None:
        sample = super().get_cached(file_idx)
        if sample is not None:
            sample["hidden_states"] = sample["hidden_states"][:, self.slots].contiguous()
        return sample


if NAME not in HiddenStatesBackend.registry:

    @HiddenStatesBackend.register(NAME)
    class SlotBackend(FileBackend):
        @staticmethod
        def from_train_args(args: argparse.Namespace, data_path: str) -> FileTransfer:
            slots = [int(s) for s in os.environ[ENV].split(",")]
            base = Path(args.hidden_states_path) if args.hidden_states_path else Path(data_path) / "hidden_states"
            return SlotTransfer(base, slots)
