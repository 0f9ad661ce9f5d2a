"""Adapter to speculators internals (checked against speculators 0.9.0 and hs-connectors as
installed with it). Everything here patches or subclasses something speculators does not
offer as an extension point; the stages call these and nothing else of its private API.

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
- `speculators.train.cli.setup_metric_logger` and the "speculators.metrics" logger's record
  format (`capture_metrics`: keeps the metric dicts its MLflow logger receives).
- through `speculators_slots` (imported by `register_slot_backend`): hs-connectors'
  `FileBackend`, `FileTransfer.get_cached` and `HiddenStatesBackend.registry`.
- `speculators.train.config.resolution.build_parser` and argparse's `_actions`
  (`negatable_flags`: which train flags take a `--no-` form, so that
  `train.extra_args: {norm_output: false}` can say false).
- the log line "Skipping sample N due to error: ..." of
  `speculators.cli.generate_offline_data` (`SkipRecorder`: names the samples it gave up on).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import io
import json
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.errors import ConfigError
from runner.tracking import flatten
from runner.versions import lib_version

# The hidden-states backend that reads only some slots (speculators_slots.py), and the variable
# that says which ("0,2,4").
SLOT_BACKEND = "runner-slots"
SLOTS_ENV = "EAGLE3_RUNNER_SLOTS"
# Seconds between the training progress lines.
PROGRESS_EVERY_S = 30.0
# "1": speculators' per-step records also go to the console (train.echo_steps).
ECHO_STEPS_ENV = "EAGLE3_RUNNER_ECHO_STEPS"
# speculators' data-generation client logs each sample it gives up on with this line.
_SKIPPED = re.compile(r"Skipping sample (\d+) due to error: (.*)")
GENERATE_LOGGER = "speculators.cli.generate_offline_data"
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


# Signals that mean "checkpoint and stop": Ctrl-C, a scheduler's cancel, Slurm's warning before a
# time limit (sent through submitit).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class _Progress:
    """A line per PROGRESS_EVERY_S seconds while training: steps done of the epoch, rate and
    time left. The runner's log is a file or a pipe, where speculators' live progress bar shows
    only at the end of an epoch."""

    def __init__(self, epoch: int, epochs: int, steps: int, start: int) -> None:
        self.epoch, self.epochs, self.steps, self.first = epoch, epochs, steps, start
        self.t0: float | None = None
        self.last = time.time()

    def step(self, at: int) -> None:
        now = time.time()
        if self.t0 is None:
            # The rate counts from the first finished step: the first one also compiles (minutes
            # on a GPU from cold caches), which would make every estimate after it far too long.
            self.t0, self.first = now, at
            return
        if now - self.last < PROGRESS_EVERY_S or at >= self.steps:
            return
        self.last = now
        rate = (at - self.first) / (now - self.t0)
        left = (self.steps - at) / rate if rate > 0 else float("nan")
        log.info(
            "[train] epoch %d/%d, step %d/%d (%.0f%%), %.2f steps/s, epoch ends in %s",
            self.epoch + 1,
            self.epochs,
            at,
            self.steps,
            100 * at / self.steps,
            rate,
            _clock(left) if left == left else "?",
        )


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
            for sig, old in state.previous_handlers.items():
                if sig != signal.SIGUSR1:  # kept for the requeue after the checkpoint
                    signal.signal(sig, old)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    state.previous_handlers = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in state.previous_handlers.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


def chain_requeue(state: TrainingState) -> None:
    """After a SIGUSR1 checkpoint, hand the signal to whoever handled it before us (submitit's
    handler requeues the Slurm job)."""
    old = state.previous_handlers.get(signal.SIGUSR1)
    if state.stop_signal == "SIGUSR1" and callable(old):
        old(signal.SIGUSR1, None)


@contextmanager
def runner_training(state: TrainingState, device: str | None = None) -> Iterator[None]:
    """Run speculators' trainer the way the runner needs, for one `cli.main` call:

    - on a machine without an accelerator: the trainer moves the model and batches to
      `local_rank` (an int, i.e. cuda:0), autocasts on `current_accelerator()` (falling back to
      "cuda"), and its step timer calls `torch.accelerator.synchronize()`, which raises on a
      CPU-only host; `torch.distributed` goes through gloo instead of the accelerator's backend;
    - stops on SIGINT, SIGTERM or SIGUSR1 at the next step boundary, with a mid-epoch
      checkpoint that speculators resumes from (its own handler saves an "interrupted" one that
      it does not resume from), then raises StopRequested; all ranks agree on the boundary;
    - records where training got to in `state`.
    """
    import speculators.train.checkpointer as checkpointer_mod
    import speculators.train.cli as cli  # speculators imports torch: seconds
    import speculators.train.trainer as trainer_mod
    import torch
    import torch.distributed as dist

    has_gpu = torch.accelerator.is_available()
    if device == "cuda" and not has_gpu:  # never train on another device than configured
        raise ConfigError(
            "hardware", "hardware.device is cuda but torch sees no GPU here; choose hardware=cpu"
        )
    # The configured device decides (a CPU config on a GPU machine trains on the CPU, as keyed);
    # None (benchmarks) = whatever this machine has.
    on_cpu = device == "cpu" if device is not None else not has_gpu
    base_trainer = trainer_mod.Trainer
    base_timer = trainer_mod._StepTimer
    base_setup_distributed = cli.maybe_setup_distributed
    base_device = checkpointer_mod.get_current_device

    class RunnerTrainer(base_trainer):  # type: ignore[misc, valid-type]
        def setup_trainer(self) -> None:
            if on_cpu:
                # Runs after __init__ chose local_rank/device_type, before setup_model uses them.
                self.local_rank = "cpu"
                self.device_type = "cpu"
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
            progress = _Progress(epoch, self.config.num_epochs, len(self.train_loader), start)

            def on_step() -> None:
                nonlocal done
                done += 1
                if getattr(self, "rank", 0) == 0:
                    progress.step(start + done)
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
            with _stop_signals(state):
                return base_trainer.run_training.__wrapped__(self)

    class CPUStepTimer(base_timer):  # type: ignore[misc, valid-type]
        # Same measurements without the accelerator barrier: CPU work is synchronous.
        def mark(self, name: str) -> None:
            if self.enabled:
                self._marks[name] = time.perf_counter()

        def now(self) -> float | None:
            return time.perf_counter() if self.enabled else None

    def setup_distributed_on_cpu(sp_size: int = 1) -> None:
        """speculators' maybe_setup_distributed with gloo, for ranks without an accelerator."""
        import speculators.train.distributed as d

        if "LOCAL_RANK" not in os.environ:
            return
        dist.init_process_group("gloo")
        d._local_rank = int(os.environ["LOCAL_RANK"])
        d._is_distributed = True
        d._rank, d._world_size = dist.get_rank(), dist.get_world_size()
        d._init_sp_process_groups(d._rank, d._world_size, sp_size)

    cli.Trainer = RunnerTrainer
    if on_cpu:
        trainer_mod._StepTimer = CPUStepTimer
        cli.maybe_setup_distributed = setup_distributed_on_cpu
        # Resuming loads checkpoints onto "the current accelerator", "cuda:0" when there is none.
        checkpointer_mod.get_current_device = lambda: "cpu"
    fix_fused_loss_for_torch_compile()
    try:
        yield
    finally:
        cli.Trainer = base_trainer
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

    from runner.versions import version_tuple

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


class MetricCapture(logging.Handler):
    """Keeps speculators' metric records (the dicts its MLflow logger receives), flattened to
    "train/loss"-style keys; with `path`, also appends each to that JSONL file as it comes, so a
    run that is killed keeps what it logged."""

    def __init__(self, path: Path | None = None) -> None:
        super().__init__()
        self.records: list[dict[str, Any]] = []
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict) and not getattr(record, "hparams", False):
            numbers = {
                k: float(v)
                for k, v in flatten(record.msg, sep="/").items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            entry = {"step": getattr(record, "step", None), **numbers}
            self.records.append(entry)
            if self.path is not None:
                with open(self.path, "a") as fh:
                    fh.write(json.dumps(entry) + "\n")


# Sections of speculators' resolved settings that belong to other draft methods than the one
# trained (speculators 0.9 logs all of them).
_OTHER_METHODS = ("dflash", "dflash2", "dspark", "xpress", "peagle", "mtp")


class SettingsAsParams(logging.Filter):
    """On speculators' MLflow handler: its resolved settings (the record it logs with
    `hparams=True`, `log_run_config`) become MLflow params under "speculators.", not 65
    one-point metrics; sections for draft methods this run does not train are left out. Every
    other record (the training curves) passes to the handler unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "hparams", False) or not isinstance(record.msg, dict):
            return True
        settings = dict(record.msg)
        kind = settings.get("speculator_type")
        for section in _OTHER_METHODS:
            if section != kind:
                settings.pop(section, None)
        try:
            import mlflow  # the handler's own run: MLFLOW_RUN_ID or the active run

            flat = flatten(settings, "speculators.")
            items = [(k, str(v)[:6000]) for k, v in flat.items()]
            for i in range(0, len(items), 100):
                mlflow.log_params(dict(items[i : i + 100]))
        except Exception as exc:
            log.warning("could not log speculators' settings as MLflow params: %s", exc)
        return False


@contextmanager
def capture_metrics(path: Path | None = None) -> Iterator[MetricCapture]:
    """Collect the metric records of one speculators training call (and append them to
    `path`)."""
    import speculators.train.cli as cli

    capture = MetricCapture(path)
    original = cli.setup_metric_logger

    def setup_then_capture(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)  # dictConfig: our handler must come after it
        metrics_log = logging.getLogger("speculators.metrics")
        for handler in metrics_log.handlers:
            if type(handler).__name__ == "MLFlowHandler":
                handler.addFilter(SettingsAsParams())
        metrics_log.addHandler(capture)
        # Its per-step dicts go to MLflow and metrics.jsonl, not to the console (they were half
        # of a run's log); the runner prints a progress line instead (train.echo_steps: both).
        metrics_log.propagate = os.environ.get(ECHO_STEPS_ENV) == "1"
        return result

    cli.setup_metric_logger = setup_then_capture
    try:
        yield capture
    finally:
        cli.setup_metric_logger = original
        logging.getLogger("speculators.metrics").removeHandler(capture)
        logging.getLogger("speculators.metrics").propagate = True


def register_slot_backend() -> None:
    """Register the "runner-slots" hidden-states backend (runner/integrations/
    speculators_slots.py), which returns only the slots listed in EAGLE3_RUNNER_SLOTS."""
    import runner.integrations.speculators_slots  # noqa: F401  (registers on import; imports torch)


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


def _flag_of(error: str) -> str | None:
    """The flag an argparse / pydantic message from speculators' `TrainConfig.resolve` is about:
    "argument --optimizer: invalid choice", "unrecognized arguments: --foo 1", or
    "invalid configuration: trainer.checkpoint_freq: ..." (field -> --checkpoint-freq)."""
    for pattern in (r"argument (--[\w-]+)", r"unrecognized arguments: (--[\w-]+)"):
        m = re.search(pattern, error)
        if m:
            return m.group(1)
    m = re.search(r"invalid configuration:\s+(?:\w+\.)*(\w+):", error)
    return "--" + m.group(1).replace("_", "-") if m else None


def check_train_flags(
    argv: list[str], keys: dict[str, str], cache_dir: Path
) -> tuple[str, str] | None:
    """(runner key, message) when speculators' own `TrainConfig.resolve` refuses `argv` (its
    choices, ranges and loss names apply), else None. `keys` maps each flag to the runner key it
    comes from. Importing speculators takes seconds, so the answer is remembered per argv and
    speculators version under `cache_dir`."""
    version = lib_version("speculators")
    digest = hashlib.sha256(json.dumps([argv, version]).encode()).hexdigest()[:16]
    cached = cache_dir / "train_flags" / f"{digest}.json"
    if cached.is_file():
        answer = json.loads(cached.read_text())
        return tuple(answer) if answer else None  # type: ignore[return-value]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            resolve_train_config(argv, slots=(), quiet=True)
        answer = None
    except _Refused:
        text = err.getvalue().strip().splitlines()
        # argparse prints the usage, then "<prog>: error: <message>" (and more lines for pydantic)
        start = next((i for i, line in enumerate(text) if ": error: " in line), len(text) - 1)
        message = " ".join(line.strip() for line in text[start:]).split(": error: ", 1)[-1]
        flag = _flag_of(message)
        key = keys.get(flag or "", "train.extra_args")
        answer = (key, f"speculators {version} refuses it: {message}")
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(answer))
    os.replace(tmp, cached)
    return answer


class _Refused(Exception):
    """speculators' argument parser exited on the flags (its message went to stderr)."""


def resolve_train_config(argv: list[str], slots: tuple[int, ...], quiet: bool = False) -> Any:
    """speculators' TrainConfig for `argv` (registering the slot backend when it is named);
    a flag speculators refuses is the config's fault."""
    from speculators.train.config import TrainConfig  # speculators imports torch: seconds

    if SLOT_BACKEND in argv:
        register_slot_backend()
        os.environ[SLOTS_ENV] = ",".join(str(i) for i in slots)
    try:
        return TrainConfig.resolve(argv)
    except SystemExit as exc:  # speculators parses flags with argparse, which exits on a bad one
        if quiet:
            raise _Refused() from None
        raise ConfigError(
            "train.extra_args",
            f"speculators rejected its arguments (exit {exc.code}); see the message above. "
            f"Arguments: {' '.join(argv)}",
        ) from None


def mask_token_id(path: str, vocab_size: int, trust_remote_code: bool) -> int:
    """speculators' own `resolve_mask_token_id` (the value `--mask-token-id` defaults to), reading
    the tokenizer alone. Without the flag speculators loads the target's AutoProcessor for it,
    which for a multimodal target (Kimi-K2.5) loads the image processor as well: transformers'
    needs torchvision, the real model's is remote code; the mask token is the tokenizer's either
    way. Private API touched: `speculators.train.utils.load_processor` (swapped for the call)."""
    import speculators.train.utils as su
    from transformers import AutoTokenizer

    def tokenizer_only(target: str, *, trust_remote_code: bool = False) -> Any:
        tok = AutoTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code)
        if tok.pad_token is None:  # as speculators' load_processor does
            tok.pad_token = tok.eos_token
        return tok

    original = su.load_processor
    su.load_processor = tokenizer_only
    try:
        found = su.resolve_mask_token_id(
            path, vocab_size, None, trust_remote_code=trust_remote_code
        )
        return int(found)
    finally:
        su.load_processor = original


def run_training(
    argv: list[str], slots: tuple[int, ...], work: Path, device: str | None = None
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
    config = resolve_train_config(argv, slots)
    state = TrainingState(progress_path=work / "progress.json")
    status = "finished"
    with capture_metrics(work / "metrics.jsonl" if rank0 else None), runner_training(state, device):
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
