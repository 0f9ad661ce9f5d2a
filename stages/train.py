"""Stage `train`: an EAGLE-3 draft trained by speculators' own trainer on the extracted files.

Run alone: `python -m runner run.stages=[train]` (needs prepare, extract and vocab in the store).
Builds speculators' TrainConfig from `cfg.train` (the same flags `speculators train` takes),
points it at the prepared dataset, the hidden-state folder and the vocab mapping, and calls
`speculators.train.cli.main`. On a CPU-only host `stages.speculators_cpu` adapts the trainer.
speculators' MLflow logger writes its metrics into the runner's active run; the same records are
kept in `metrics.jsonl`. Publishes `draft/`: the checkpoint (config.json + model.safetensors in
speculators' format, which vLLM serves with `speculative_config={"method": "eagle3", ...}`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

NAME = "train"
UPSTREAM = ("prepare", "extract", "vocab")
VERSION = "1"
LIBRARIES = {"speculators": ("speculators",), "torch": ("torch",)}

# Settings that change how fast training runs, not what it produces.
_NOT_IN_KEY = ("name", "num_workers", "log_freq")


def key_config(cfg: Any, facts: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    t = OmegaConf.to_container(cfg.train, resolve=True)
    return {**{k: v for k, v in t.items() if k not in _NOT_IN_KEY}, "aux_layers": list(facts.aux_layers),
            "device": cfg.hardware.device}


def speculators_argv(cfg: Any, facts: Any, data_path: Path, hidden_states: Path, vocab: Path,
                     save_path: Path, extra: list[str] | None = None) -> list[str]:
    """The `speculators train` command line for this config (recorded in the manifest too)."""
    t = cfg.train
    argv = [
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", facts.path,
        "--data-path", str(data_path),
        "--hidden-states-path", str(hidden_states),
        "--d2t-path", str(vocab / "d2t.npy"),
        "--t2d-path", str(vocab / "t2d.npy"),
        "--draft-vocab-size", str(t.draft_vocab_size),
        "--target-layer-ids", *[str(x) for x in facts.aux_layers],
        "--num-layers", str(t.num_layers),
        "--ttt-steps", str(t.ttt_steps),
        "--epochs", str(t.epochs),
        "--lr", str(t.lr),
        "--optimizer", t.optimizer,
        "--scheduler-type", t.scheduler,
        "--scheduler-warmup-ratio", str(t.warmup_ratio),
        "--total-seq-len", str(t.total_seq_len or cfg.data.max_seq_len),
        "--train-data-ratio", str(1.0 - t.val_ratio),
        "--loss-fn", t.loss_fn,
        "--loss-implementation", t.loss_implementation,
        "--draft-attn-impl", t.draft_attn_impl,
        "--num-workers", str(t.num_workers),
        "--log-freq", str(t.log_freq),
        "--seed", str(t.seed),
        "--hidden-states-dtype", cfg.hardware.dtype,
        "--on-missing", "raise",
        "--save-path", str(save_path),
        "--log-dir", str(save_path.parent / "logs"),
        "--no-resume-from-checkpoint",
    ]
    if t.max_steps is not None:
        argv += ["--max-steps", str(t.max_steps)]
    if facts.train_slots != tuple(range(len(facts.extract_ids))):
        # The files hold a sweep's superset of layers; read only this job's slots.
        argv += ["--hidden-states-backend", "runner-slots"]
    if cfg.model.trust_remote_code:
        argv += ["--trust-remote-code"]
    for k, v in dict(t.extra_args).items():
        flag = "--" + str(k).replace("_", "-")
        if isinstance(v, bool):
            argv += [flag] if v else []
        elif isinstance(v, (list, tuple)):
            argv += [flag, *[str(x) for x in v]]
        else:
            argv += [flag, str(v)]
    return argv + (extra or [])


def _flat(d: dict, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = float(v)
    return out


class _MetricCapture(logging.Handler):
    """Keeps speculators' metric records (the dicts its MLflow logger receives)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict) and not getattr(record, "hparams", False):
            self.records.append({"step": getattr(record, "step", None), **_flat(record.msg)})


@contextmanager
def _capture_metrics() -> Iterator[_MetricCapture]:
    import speculators.train.cli as cli

    capture = _MetricCapture()
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


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    """First/last training values and the last validation values, for the manifest and MLflow."""
    train = [r for r in records if any(k.startswith("train/") for k in r)]
    val = [r for r in records if any(k.startswith("val/") for k in r)]
    out: dict[str, Any] = {"steps": len(train)}
    if train:
        first, last = train[0], train[-1]
        for k, v in last.items():
            if k.startswith("train/"):
                out[f"final_{k[6:]}"] = v
        if "train/loss" in first:
            out["first_loss"] = first["train/loss"]
    if val:
        for k, v in val[-1].items():
            if k.startswith("val/"):
                out[f"val_{k[4:]}"] = v
    return out


def _pick_checkpoint(save_path: Path) -> Path:
    best = save_path / "checkpoint_best"
    if best.exists():
        return best.resolve()
    epochs = sorted((p for p in save_path.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    if not epochs:
        raise RuntimeError(f"speculators wrote no checkpoint under {save_path}")
    return epochs[-1]


def run(ctx: Any) -> dict[str, Any]:
    import torch
    from speculators.train.cli import main as speculators_train
    from speculators.train.config import TrainConfig

    from stages.speculators_cpu import cpu_training

    cfg = ctx.cfg
    if cfg.hardware.cpu_threads:
        torch.set_num_threads(cfg.hardware.cpu_threads)
    work = ctx.scratch
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    save_path = work / "checkpoints"
    argv = speculators_argv(
        cfg, ctx.facts,
        data_path=ctx.inputs["prepare"].path / "dataset",
        hidden_states=ctx.inputs["extract"].path / "hidden_states",
        vocab=ctx.inputs["vocab"].path,
        save_path=save_path,
        extra=["--logger", "mlflow"] if ctx.tracker is not None else [],
    )
    ctx.manifest["speculators_argv"] = argv
    if "runner-slots" in argv:
        import stages.slot_backend  # noqa: F401  (registers the backend with speculators)

        os.environ["EAGLE3_RUNNER_SLOTS"] = ",".join(str(i) for i in ctx.facts.train_slots)
        ctx.manifest["slots"] = list(ctx.facts.train_slots)
    try:
        train_config = TrainConfig.resolve(argv)
    except SystemExit as exc:  # speculators parses flags with argparse, which exits on a bad one
        from runner.errors import ConfigError

        raise ConfigError("train.extra_args", f"speculators rejected its arguments (exit {exc.code}); "
                                              f"see the message above. Arguments: {' '.join(argv)}") from None
    with _capture_metrics() as capture, cpu_training():
        speculators_train(train_config)
    records = capture.records
    with open(ctx.out / "metrics.jsonl", "w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    ckpt = _pick_checkpoint(save_path)
    draft = ctx.out / "draft"
    draft.mkdir()
    # Publish the weights and config only: optimizer and scheduler states are for resuming.
    for f in ckpt.iterdir():
        if f.is_file() and not f.name.endswith(("optimizer_state_dict.pt", "scheduler_state_dict.pt")):
            shutil.copy2(f, draft / f.name)
    for f in ("run.yaml", "train_command.txt"):
        if (save_path / f).exists():
            shutil.copy2(save_path / f, ctx.out / f)
    # Record the layer-id convention in the draft's own config, beside speculators' fields.
    conf_path = draft / "config.json"
    conf = json.loads(conf_path.read_text())
    conf["eagle3_runner"] = {
        "layer_id_convention": "vllm (id k = input of decoder layer k; n = final layer before norm)",
        "aux_layer_ids": list(ctx.facts.aux_layers),
        "capture_ids": list(ctx.facts.capture_ids),
        "target_num_layers": ctx.facts.num_layers,
    }
    conf_path.write_text(json.dumps(conf, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return {**summarise(records), "checkpoint_bytes": sum(f.stat().st_size for f in draft.iterdir())}
