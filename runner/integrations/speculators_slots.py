"""The "runner-slots" hidden-states backend for speculators (hs-connectors as installed with
speculators 0.9.0): reads only some slots of each hidden-state file.

A sweep over capture layers extracts once, capturing the union of the sweep's layers (plus the
final layer); each job trains on its own. speculators reads every slot of a file
(`hidden_states[:, :-1]` as the draft's input), so the selection happens in the transfer
object, which is pickled into DataLoader workers (so its class lives at module level here).
Online training (extract.mode=online) fetches from a server that captures the union as well;
`get_generated` selects the same slots. Private APIs touched: `hs_connectors.transfer.
FileBackend`, `FP8Transfer.get_cached` and `get_generated`,
`HiddenStatesBackend.registry`. Imported by `runner.integrations.speculators.
register_slot_backend` only when a run needs it: hs-connectors imports torch.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from hs_connectors import FP8Transfer, HiddenStatesBackend
from hs_connectors.transfer import FileBackend

from runner.integrations import SLOT_BACKEND, SLOTS_ENV


class SlotTransfer(FP8Transfer):
    """FP8Transfer dequantizes fp8 files and passes others through unchanged, so one reader
    serves both storages (extract.storage)."""

    def __init__(self, hidden_states_path: Path, slots: list[int]):
        super().__init__(hidden_states_path)
        self.slots = slots

    def _select(self, sample: dict[str, Any] | None) -> dict[str, Any] | None:
        if sample is not None:
            sample["hidden_states"] = sample["hidden_states"][:, self.slots].contiguous()
        return sample

    def get_cached(self, file_idx: int) -> dict[str, Any] | None:
        return self._select(super().get_cached(file_idx))

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, Any] | None:
        # Online: a server shared by a sweep captures the union of its layers.
        return self._select(super().get_generated(hs_transfer_params))


class SlotBackend(FileBackend):
    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> FP8Transfer:
        slots = [int(s) for s in os.environ[SLOTS_ENV].split(",")]
        base = args.hidden_states_path or Path(data_path) / "hidden_states"
        return SlotTransfer(Path(base), slots)


if SLOT_BACKEND not in HiddenStatesBackend.registry:
    HiddenStatesBackend.register(SLOT_BACKEND)(SlotBackend)
