"""speculators' checkpoint folder as the runner reads it (checked against speculators 0.9.0): the
epochs' folders, the one to publish, and the files that only resume a training."""

from __future__ import annotations

from pathlib import Path

# speculators' checkpoint folder: one subfolder per epoch (`<save_path>/<epoch>`, from 0), a
# `checkpoint_best` link to the lowest validation loss, and beside each draft the states it
# resumes from (not part of a published draft).
BEST_CHECKPOINT = "checkpoint_best"
RESUME_ONLY = ("optimizer_state_dict.pt", "scheduler_state_dict.pt")
TRAINING_STATE = "training_state.json"


def epoch_dirs(save_path: Path) -> list[Path]:
    """speculators' checkpoint folders, one per epoch, in order."""
    found = (p for p in save_path.glob("[0-9]*") if p.is_dir() and p.name.isdigit())
    return sorted(found, key=lambda p: int(p.name))


def best_checkpoint(save_path: Path) -> Path:
    """The checkpoint to publish: speculators' best by validation loss, else the last epoch."""
    best = save_path / BEST_CHECKPOINT
    if best.exists():
        return best.resolve()
    epochs = epoch_dirs(save_path)
    if not epochs:
        raise RuntimeError(f"speculators wrote no checkpoint under {save_path}")
    return epochs[-1]
