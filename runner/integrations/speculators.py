"""speculators' trainer run by the runner (checked against speculators 0.9.0): on a CPU and over
gloo, stopped at a step boundary with a resumable checkpoint, its epoch bar replaced by a
progress line, and the export check's validation pass. The adapter's other parts sit beside it:
its settings (speculators_config.py), what it logs (speculators_metrics.py), its checkpoint
folder (speculators_checkpoints.py), the slot backend (speculators_slots.py) and the CPU
kernels (speculators_cpu.py). Everything here patches or subclasses something speculators does
not offer as an extension point; the stages call these and nothing else of its private API.

Private APIs touched:
- `speculators.train.trainer.Trainer`: `setup_trainer` and its `local_rank` / `device_type` /
  `global_step` / `_resume_local_step` attributes, `train_epoch`'s `step_callback`,
  `maybe_save_checkpoint(epoch, local_step)`, `run_training.__wrapped__` (the method without
  speculators' interrupt decorator), `is_distributed`; `speculators.train.trainer._StepTimer`;
  `speculators.train.cli.Trainer` and `cli.maybe_setup_distributed`; the module state of
  `speculators.train.distributed` (`_rank`, `_world_size`, `_init_sp_process_groups`, ...);
  `speculators.train.checkpointer.get_current_device` (it answers "cuda:0" without a GPU)
  (`runner_training`: CPU, gloo, stop at a step boundary with a resumable checkpoint).
- `speculators.losses.fused.loss_forward_kernel` / `loss_backward_kernel` autotuner `configs`
  and `keys` (`fix_fused_loss_for_torch_compile`, torch 2.11 only).
- `speculators.train.trainer.tqdm` (its epoch bar, replaced by the progress line while the
  runner trains);
- `speculators.train.config.resolution.DECODER_SHAPING_FLAGS` (`validate_export`);
- on a CPU, through `speculators_cpu.cpu_kernels`: the eager KL loss and the argmax of the
  EAGLE-3 forward and metrics (faster kernels, the same values).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.core.errors import ConfigError
from runner.core.interrupts import STOP_SIGNALS, foreign, handling
from runner.integrations.speculators_config import Refused, resolve_train_config
from runner.integrations.speculators_metrics import capture_metrics

# Seconds between the training progress lines.
PROGRESS_EVERY_S = 30.0
log = logging.getLogger("runner")


class StopRequested(Exception):
    """Raised at a step boundary once a stop signal arrived and the checkpoint is saved."""


@dataclass
class TrainingState:
    """What one training call reports back: where it got to, and whether it was asked to stop."""

    # The signal that asked for a stop (first one wins), or None.
    stop_signal: str | None = None
    # Global step this call started from (> 0 after a resume) and the last one it finished.
    resumed_from_step: int = 0
    global_step: int = 0
    epoch: int = 0
    local_step: int = 0
    # Handlers that were in place before ours, e.g. submitit's SIGUSR1 requeue.
    previous_handlers: dict[int, Any] = field(default_factory=dict)
    # Rank 0 writes {"global_step": n} here after every step (what a killed run got to).
    progress_path: Path | None = None
    # speculators' metric records so far (MetricCapture's list): the progress line's loss.
    records: list[dict[str, Any]] = field(default_factory=list)
    # The export check: one validation pass instead of training, its metrics kept here.
    validate_only: bool = False
    val_metrics: dict[str, float] | None = None


class _Progress:
    """A line per PROGRESS_EVERY_S seconds while training: where the stage is (global step of
    all it will take: epochs x steps, or train.max_steps if fewer), the latest training loss and
    the first positions' accuracy, the rate and the time the whole stage has left. The runner's
    log is a file or a pipe, where speculators' live progress bar shows only at an epoch's end."""

    def __init__(
        self, epoch: int, epochs: int, steps: int, total: int, records: list[dict[str, Any]]
    ) -> None:
        self.epoch, self.epochs, self.steps, self.total = epoch, epochs, steps, total
        self.records = records
        self.seen = 0  # records already averaged into an earlier line
        self.t0: float | None = None
        self.first = 0
        self.last = time.time()

    def step(self, global_step: int) -> None:
        now = time.time()
        if self.t0 is None:
            # The rate counts from the first finished step: the first one also compiles (minutes
            # on a GPU from cold caches), which would make every estimate after it far too long.
            self.t0, self.first = now, global_step
            return
        if now - self.last < PROGRESS_EVERY_S or global_step >= self.total:
            return
        self.last = now
        rate = (global_step - self.first) / (now - self.t0)
        left = (self.total - global_step) / rate if rate > 0 else float("nan")
        log.info(
            "[train] step %d/%d (epoch %d/%d)%s, %.2f steps/s, stage ends in %s",
            global_step,
            self.total,
            self.epoch + 1,
            self.epochs,
            self.latest(),
            rate,
            _clock(left) if left == left else "?",
        )

    def latest(self) -> str:
        """ ", loss 4.12, acc 0.31/0.12/0.05 (mean of 37 steps)": the training loss and the
        accuracy at the first three positions (speculators' full_acc_k: all of 0..k right),
        averaged over the steps since the last line (one step's loss jumps by a third from one
        batch to the next: 22.0, 18.4, 11.1, 9.9, 8.4, 13.3)."""
        new = [r for r in self.records[self.seen :] if "train/loss" in r]
        self.seen = len(self.records)
        if not new:
            new = [r for r in self.records if "train/loss" in r][-1:]
        if not new:
            return ""

        def mean(key: str) -> float | None:
            vals = [r[key] for r in new if key in r]
            return sum(vals) / len(vals) if vals else None

        accs = [a for k in range(3) if (a := mean(f"train/full_acc_{k}")) is not None]
        acc = "/".join(f"{a:.2f}" for a in accs)
        over = f" (mean of {len(new)} steps)" if len(new) > 1 else ""
        return f", loss {mean('train/loss'):.3f}" + (f", acc {acc}" if acc else "") + over


def _clock(seconds: float) -> str:
    """H:MM:SS (MM:SS under an hour)."""
    h, rest = divmod(int(seconds), 3600)
    return (
        f"{h}:{time.strftime('%M:%S', time.gmtime(rest))}"
        if h
        else time.strftime("%M:%S", time.gmtime(rest))
    )


@contextmanager
def _stop_signals(state: TrainingState) -> Iterator[None]:
    """The first stop signal sets `state.stop_signal`; the trainer acts on it at the next step
    boundary. Later signals get the previous handlers (a second Ctrl-C forces the exit)."""

    def handler(signum: int, _frame: Any) -> None:
        if state.stop_signal is None:
            state.stop_signal = signal.Signals(signum).name
            if os.environ.get("RANK", "0") == "0":  # one line for the job, not one per rank
                # Said at once (a step can take half a minute on a CPU); os.write: a handler
                # may interrupt a print.
                os.write(
                    2,
                    f"\n[train] {state.stop_signal}: stopping after this step, with a "
                    "checkpoint to resume from (the same signal again stops now)\n".encode(),
                )
            for sig, old in state.previous_handlers.items():
                if sig != signal.SIGUSR1:  # kept for the requeue after the checkpoint
                    signal.signal(sig, old)

    with handling(STOP_SIGNALS, handler) as previous:
        state.previous_handlers = previous
        yield


def chain_requeue(state: TrainingState) -> None:
    """After a SIGUSR1 checkpoint, hand the signal to whoever handled it before us (submitit's
    handler requeues the Slurm job)."""
    old = state.previous_handlers.get(signal.SIGUSR1)
    if state.stop_signal == "SIGUSR1" and foreign(old):
        old(signal.SIGUSR1, None)


def _trainer_class(base_trainer: type, state: TrainingState, on_cpu: bool, compute: Any) -> type:
    """speculators' Trainer as the runner runs it (`runner_training`): on the CPU when asked, in
    float32 when asked, stopping at a step boundary every rank agrees on with a checkpoint it
    resumes from, its progress in `state` and on the console."""
    import torch
    import torch.distributed as dist

    class RunnerTrainer(base_trainer):  # type: ignore[misc, valid-type]
        def setup_trainer(self) -> None:
            if on_cpu:
                # Runs after __init__ chose local_rank/device_type, before setup_model uses them.
                self.local_rank = "cpu"
                self.device_type = "cpu"
            if compute == torch.float32:
                self.model.float()
            super().setup_trainer()
            state.resumed_from_step = state.global_step = self.global_step

        def _stop_now(self) -> bool:
            asked = state.stop_signal is not None
            if not self.is_distributed:
                return asked
            flag = torch.tensor([float(asked)], device="cpu" if on_cpu else self.local_rank)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same step
            return bool(flag.item())

        def train_epoch(self, epoch: int, *, step_callback: Any = None) -> Any:
            start = getattr(self, "_resume_local_step", 0)  # read before speculators resets it
            done = 0
            steps = len(self.train_loader)
            total = self.config.num_epochs * steps
            if self.config.max_steps is not None:
                total = min(total, self.config.max_steps)
            progress = _Progress(epoch, self.config.num_epochs, steps, total, state.records)

            def on_step() -> None:
                nonlocal done
                done += 1
                if getattr(self, "rank", 0) == 0:
                    progress.step(self.global_step)
                if step_callback is not None:
                    step_callback()
                state.epoch, state.local_step = epoch, start + done
                state.global_step = self.global_step
                if state.progress_path is not None and getattr(self, "rank", 0) == 0:
                    tmp = state.progress_path.with_suffix(".tmp")
                    tmp.write_text(json.dumps({"global_step": self.global_step}))
                    os.replace(tmp, state.progress_path)
                if self._stop_now():
                    self.maybe_save_checkpoint(epoch, local_step=start + done)
                    raise StopRequested(
                        f"stopped by {state.stop_signal or 'another rank'} at epoch {epoch} "
                        f"step {start + done} (global step {self.global_step}); checkpoint saved"
                    )

            return super().train_epoch(epoch, step_callback=on_step)

        def run_training(self) -> Any:
            # speculators' own decorator turns the first signal into an exception anywhere in
            # the step (and an "interrupted" checkpoint it does not resume from); ours waits for
            # the step boundary instead.
            if state.validate_only:
                state.val_metrics = self.val_epoch(0)
                return None
            with _stop_signals(state):
                return base_trainer.run_training.__wrapped__(self)

    return RunnerTrainer


def _cpu_step_timer(base_timer: type) -> type:
    """speculators' step timer without the accelerator barrier: CPU work is synchronous."""

    class CPUStepTimer(base_timer):  # type: ignore[misc, valid-type]
        def mark(self, name: str) -> None:
            if self.enabled:
                self._marks[name] = time.perf_counter()

        def now(self) -> float | None:
            return time.perf_counter() if self.enabled else None

    return CPUStepTimer


def _setup_distributed_on_cpu(sp_size: int = 1) -> None:
    """speculators' maybe_setup_distributed with gloo, for ranks without an accelerator."""
    import speculators.train.distributed as d
    import torch.distributed as dist

    if "LOCAL_RANK" not in os.environ:
        return
    dist.init_process_group("gloo")
    d._local_rank = int(os.environ["LOCAL_RANK"])
    d._is_distributed = True
    d._rank, d._world_size = dist.get_rank(), dist.get_world_size()
    d._init_sp_process_groups(d._rank, d._world_size, sp_size)


@contextmanager
def runner_training(
    state: TrainingState, device: str | None = None, dtype: str | None = None
) -> Iterator[None]:
    """Run speculators' trainer the way the runner needs, for one `cli.main` call:

    - on a machine without an accelerator: the trainer moves the model and batches to
      `local_rank` (an int, i.e. cuda:0), autocasts on `current_accelerator()` (falling back to
      "cuda"), and its step timer calls `torch.accelerator.synchronize()`, which raises on a
      CPU-only host; `torch.distributed` goes through gloo instead of the accelerator's backend;
    - stops on SIGINT, SIGTERM or SIGUSR1 at the next step boundary, with a mid-epoch
      checkpoint that speculators resumes from (its own handler saves an "interrupted" one that
      it does not resume from), then raises StopRequested; all ranks agree on the boundary;
    - records where training got to in `state`;
    - in float32 (`dtype`, speculators' `hidden_states_dtype`; a CPU without native bf16): the
      draft's weights in float32 (a reloaded checkpoint is bf16, and torch's autocast does not
      cast to float32 on a CPU), and on a CPU Muon's orthogonalisation in float32 too
      (`speculators_cpu.cpu_kernels`).
    """
    import speculators.train.checkpointer as checkpointer_mod
    import speculators.train.cli as cli  # speculators imports torch: seconds
    import speculators.train.trainer as trainer_mod
    import torch

    from runner.integrations.speculators_cpu import cpu_kernels  # imports torch

    has_gpu = torch.accelerator.is_available()
    if device == "cuda" and not has_gpu:  # never train on another device than configured
        raise ConfigError(
            "hardware", "hardware.device is cuda but torch sees no GPU here; choose hardware=cpu"
        )
    # The configured device decides (a CPU config on a GPU machine trains on the CPU, as keyed);
    # None (benchmarks) = whatever this machine has.
    on_cpu = device == "cpu" if device is not None else not has_gpu
    compute = getattr(torch, dtype) if dtype else torch.bfloat16
    base_trainer = trainer_mod.Trainer
    base_timer = trainer_mod._StepTimer
    base_setup_distributed = cli.maybe_setup_distributed
    base_device = checkpointer_mod.get_current_device

    RunnerTrainer = _trainer_class(base_trainer, state, on_cpu, compute)
    CPUStepTimer = _cpu_step_timer(base_timer)
    setup_distributed_on_cpu = _setup_distributed_on_cpu
    cli.Trainer = RunnerTrainer
    # Its rich epoch bar draws only at an epoch's end in a log or a pipe; the progress line
    # (_Progress) says the same every PROGRESS_EVERY_S, in the runner's format.
    base_bar = trainer_mod.tqdm
    trainer_mod.tqdm = lambda iterable, *a, **kw: iterable
    if on_cpu:
        trainer_mod._StepTimer = CPUStepTimer
        cli.maybe_setup_distributed = setup_distributed_on_cpu
        # Resuming loads checkpoints onto "the current accelerator", "cuda:0" when there is none.
        checkpointer_mod.get_current_device = lambda: "cpu"
    fix_fused_loss_for_torch_compile()
    try:
        with cpu_kernels(compute) if on_cpu else nullcontext(), warnings.catch_warnings():
            # speculators autocasts to its hidden-states dtype; torch declines float32 on a
            # CPU with a warning a step, and runs in float32 as asked.
            warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype")
            yield
    finally:
        cli.Trainer = base_trainer
        trainer_mod.tqdm = base_bar
        trainer_mod._StepTimer = base_timer
        cli.maybe_setup_distributed = base_setup_distributed
        checkpointer_mod.get_current_device = base_device


def fix_fused_loss_for_torch_compile() -> bool:
    """torch 2.11: speculators' fused loss fails inside torch.compile with "ListVariable(...) is
    already tracked for mutation": one `triton.autotune` object decorates both
    `loss_forward_kernel` and `loss_backward_kernel` in speculators/losses/fused.py, so the two
    autotuners share their `configs` and `keys` lists. Giving the backward kernel its own copies
    (same values) fixes it and changes no number. Applied on torch 2.11 only (newer versions are
    unverified); True if applied."""
    import torch

    from runner.integrations.versions import version_tuple

    if version_tuple(torch.__version__)[:2] != (2, 11):
        return False
    try:
        import speculators.losses.fused as fused  # needs triton: GPU machines only
    except ImportError:
        return False
    fwd, bwd = fused.loss_forward_kernel, fused.loss_backward_kernel
    if getattr(bwd, "configs", None) is getattr(fwd, "configs", ()):
        bwd.configs = list(bwd.configs)
    if getattr(bwd, "keys", None) is getattr(fwd, "keys", ()):
        bwd.keys = list(bwd.keys)
    return True


def run_training(
    settings: Mapping[str, Any], slots: tuple[int, ...], work: Path, device: str | None = None
) -> TrainingState:
    """One call of speculators' trainer in this process (the only rank, or one of torchrun's).

    Rank 0 appends its metric records to work/metrics.jsonl (across resumed attempts) and writes
    work/outcome.json: {"status": "finished" | "stopped", "signal", "epoch", "local_step",
    "global_step", "resumed_from_step"}. A stop (SIGINT, SIGTERM, SIGUSR1) returns normally with
    status "stopped" after its checkpoint is saved.
    """
    import torch  # seconds; only a training call needs it
    from speculators.train.cli import main as speculators_train

    rank = int(os.environ.get("RANK", "0"))
    rank0 = rank == 0
    try:
        config = resolve_train_config(settings, slots)
    except Refused as exc:  # the plan checked the same settings: not expected here
        raise ConfigError("train.extra_args", f"speculators refuses them: {exc.message}") from None
    state = TrainingState(progress_path=work / "progress.json")
    status = "finished"
    with (
        capture_metrics(work / "metrics.jsonl" if rank0 else None) as capture,
        runner_training(state, device, settings.get("hidden_states_dtype")),
    ):
        state.records = capture.records
        try:
            speculators_train(config)
        except StopRequested as stop:
            log.warning("%s", stop)
            status = "stopped"
    if torch.cuda.is_available():  # each rank's peak, for the plan's estimate to be checked
        peak = {
            "allocated": torch.cuda.max_memory_allocated(),
            "reserved": torch.cuda.max_memory_reserved(),
        }
        (work / f"memory_rank{rank}.json").write_text(json.dumps(peak))
    if rank0:
        outcome = {
            "status": status,
            "signal": state.stop_signal,
            "epoch": state.epoch,
            "local_step": state.local_step,
            "global_step": state.global_step,
            "resumed_from_step": state.resumed_from_step,
        }
        tmp = work / "outcome.json.tmp"
        tmp.write_text(json.dumps(outcome))
        os.replace(tmp, work / "outcome.json")
    return state


def validate_export(
    settings: Mapping[str, Any], slots: tuple[int, ...], draft: Path, work: Path, device: str
) -> dict[str, float]:
    """speculators' own validation pass over the published draft folder, loaded back through
    its from_pretrained as a user (or vLLM) loads it: the same validation rows as training, one
    process. Returns its validation metrics (val/..._epoch names without the prefix)."""
    from speculators.train.cli import main as speculators_train  # imports torch: seconds
    from speculators.train.config.resolution import DECODER_SHAPING_FLAGS

    # The published config names the target by its hub id (it loads anywhere), and speculators'
    # from_pretrained resolves layer ids through it: a view of the folder whose config names the
    # local target instead, the weights linked, not copied.
    view = work / "draft"
    # A check that failed before left its view: each check starts from an empty folder (its
    # links would collide with the new ones, and the stage could never run again).
    shutil.rmtree(work, ignore_errors=True)
    view.mkdir(parents=True, exist_ok=True)
    for f in draft.iterdir():
        if f.is_file() and f.name != "config.json":
            (view / f.name).symlink_to(f.resolve())
    conf = json.loads((draft / "config.json").read_text())
    verifier = conf.get("speculators_config", {}).get("verifier", {})
    if verifier:
        verifier["name_or_path"] = settings["verifier_name_or_path"]
    (view / "config.json").write_text(json.dumps(conf))
    # The folder defines the draft: speculators refuses the flags that would shape another.
    drop = {"logger", "fsdp_shard", "max_steps", "draft_config", *DECODER_SHAPING_FLAGS}
    s = {k: v for k, v in settings.items() if k not in drop}
    s.update(from_pretrained=str(view), save_path=str(work / "save"), log_dir=str(work / "logs"))
    state = TrainingState(validate_only=True)
    with capture_metrics(None), runner_training(state, device, s.get("hidden_states_dtype")):
        speculators_train(resolve_train_config(s, slots))
    return dict(state.val_metrics or {})
