"""Adapter: run speculators 0.9.0's trainer on a machine without an accelerator.

speculators assumes a GPU in three places: the trainer moves the model and batches to
`local_rank` (an int, i.e. cuda:0), autocasts on `current_accelerator()` (falling back to
"cuda"), and its step timer calls `torch.accelerator.synchronize()`, which raises
"Cannot access accelerator device when none is available" on a CPU-only host.
`cpu_training()` swaps in a Trainer subclass and a step timer that fix exactly those, for the
duration of one training call. With a GPU present it changes nothing.

Usage: `with cpu_training(): speculators.train.cli.main(config)`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


@contextmanager
def cpu_training() -> Iterator[None]:
    import torch
    import speculators.train.cli as cli
    import speculators.train.trainer as trainer_mod

    if torch.accelerator.is_available():
        yield
        return

    base_trainer = trainer_mod.Trainer
    base_timer = trainer_mod._StepTimer  # noqa: SLF001

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
                import time

                self._marks[name] = time.perf_counter()

        def now(self) -> float | None:
            if not self.enabled:
                return None
            import time

            return time.perf_counter()

    cli.Trainer = CPUTrainer
    trainer_mod._StepTimer = CPUStepTimer  # noqa: SLF001
    try:
        yield
    finally:
        cli.Trainer = base_trainer
        trainer_mod._StepTimer = base_timer  # noqa: SLF001
