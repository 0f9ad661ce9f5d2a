"""Stage `train`: an EAGLE-3 draft trained by speculators' own trainer on the extracted files.

Run alone: `python -m runner run.stages=[train]` (needs prepare, extract and vocab in the store).
Builds speculators' TrainConfig from `cfg.train` (the same flags `speculators train` takes),
points it at the prepared dataset, the hidden-state folder and the vocab mapping, and calls
`speculators.train.cli.main`; on a CPU-only host through `runner.integrations.speculators`.
speculators' MLflow logger writes its metrics into the runner's active run; the same records are
kept in `metrics.jsonl`. Publishes `draft/`: the checkpoint (config.json + model.safetensors in
speculators' format, which vLLM serves with `speculative_config={"method": "eagle3", ...}`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runner.errors import ConfigError
from runner.integrations.speculators import (
    SLOT_BACKEND,
    SLOTS_ENV,
    capture_metrics,
    cpu_training,
    negatable_flags,
    register_slot_backend,
)
from runner.preflight import Plan, fmt_bytes
from runner.schema import RunnerConfig
from runner.stage import PlanView, Stage, StageContext
from runner.target_facts import ModelFacts

# Settings that change how fast training runs, not what it produces.
_NOT_IN_KEY = ("name", "num_workers", "log_freq")
# What a resumable checkpoint holds beside the draft; not published.
_RESUME_ONLY = ("optimizer_state_dict.pt", "scheduler_state_dict.pt")


def key_config(cfg: RunnerConfig, facts: ModelFacts) -> dict[str, Any]:
    t = dataclasses.asdict(cfg.train)
    return {
        **{k: v for k, v in t.items() if k not in _NOT_IN_KEY},
        "aux_layers": list(facts.aux_layers),
        "device": cfg.hardware.device,
    }


def extra_flags(extra_args: Mapping[str, Any]) -> list[str]:
    """`train.extra_args` as speculators flags: {norm_before_fc: true} -> [--norm-before-fc];
    false -> [--no-norm-output] where speculators has that form, else nothing (its default);
    lists -> the flag and each value; anything else -> the flag and its value."""
    argv: list[str] = []
    for k, v in extra_args.items():
        flag = "--" + str(k).replace("_", "-")
        if v is True:
            argv.append(flag)
        elif v is False:
            argv += [f"--no-{flag[2:]}"] if flag in negatable_flags() else []
        elif isinstance(v, (list, tuple)):
            argv += [flag, *[str(x) for x in v]]
        else:
            argv += [flag, str(v)]
    return argv


def speculators_argv(
    cfg: RunnerConfig,
    facts: ModelFacts,
    data_path: Path,
    hidden_states: Path,
    vocab: Path,
    save_path: Path,
    extra: list[str] | None = None,
) -> list[str]:
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
    ]  # fmt: skip
    if t.max_steps is not None:
        argv += ["--max-steps", str(t.max_steps)]
    if facts.train_slots != tuple(range(len(facts.extract_ids))):
        # The files hold a sweep's superset of layers; read only this job's slots.
        argv += ["--hidden-states-backend", SLOT_BACKEND]
    if cfg.model.trust_remote_code:
        argv += ["--trust-remote-code"]
    return argv + extra_flags(t.extra_args) + (extra or [])


def resolve_argv(argv: list[str], slots: tuple[int, ...]) -> Any:
    """speculators' TrainConfig for `argv`; a flag it refuses is the config's fault."""
    from speculators.train.config import TrainConfig  # speculators imports torch: seconds

    if SLOT_BACKEND in argv:
        register_slot_backend()
        os.environ[SLOTS_ENV] = ",".join(str(i) for i in slots)
    try:
        return TrainConfig.resolve(argv)
    except SystemExit as exc:  # speculators parses flags with argparse, which exits on a bad one
        raise ConfigError(
            "train.extra_args",
            f"speculators rejected its arguments (exit {exc.code}); see the message above. "
            f"Arguments: {' '.join(argv)}",
        ) from None


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
    epochs = sorted(
        (p for p in save_path.iterdir() if p.is_dir() and p.name.isdigit()),
        key=lambda p: int(p.name),
    )
    if not epochs:
        raise RuntimeError(f"speculators wrote no checkpoint under {save_path}")
    return epochs[-1]


def run(ctx: StageContext) -> dict[str, Any]:
    from speculators.train.cli import main as speculators_train  # imports torch: seconds

    save_path = ctx.scratch / "checkpoints"
    argv = speculators_argv(
        ctx.cfg,
        ctx.facts,
        data_path=ctx.inputs["prepare"].path / "dataset",
        hidden_states=ctx.inputs["extract"].path / "hidden_states",
        vocab=ctx.inputs["vocab"].path,
        save_path=save_path,
        extra=["--logger", "mlflow"] if ctx.tracker is not None else [],
    )
    ctx.manifest["speculators_argv"] = argv
    if SLOT_BACKEND in argv:
        ctx.manifest["slots"] = list(ctx.facts.train_slots)
    train_config = resolve_argv(argv, ctx.facts.train_slots)
    with capture_metrics() as capture, cpu_training():
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
        if f.is_file() and not f.name.endswith(_RESUME_ONLY):
            shutil.copy2(f, draft / f.name)
    for f in ("run.yaml", "train_command.txt"):
        if (save_path / f).exists():
            shutil.copy2(save_path / f, ctx.out / f)
    # Record the layer-id convention in the draft's own config, beside speculators' fields.
    conf_path = draft / "config.json"
    conf = json.loads(conf_path.read_text())
    conf["eagle3_runner"] = {
        "layer_id_convention": (
            "vllm (id k = input of decoder layer k; n = final layer before norm)"
        ),
        "aux_layer_ids": list(ctx.facts.aux_layers),
        "capture_ids": list(ctx.facts.capture_ids),
        "target_num_layers": ctx.facts.num_layers,
    }
    conf_path.write_text(json.dumps(conf, indent=2))
    checkpoint_bytes = sum(f.stat().st_size for f in draft.iterdir())
    return {**summarise(records), "checkpoint_bytes": checkpoint_bytes}


def draft_params(cfg: RunnerConfig, view: PlanView) -> int:
    """Parameters of the draft: fc from the aux layers, decoder layers, and its LM head."""
    layout, t = view.target.layout, cfg.train
    h = layout.hidden_size
    text = view.target.config.get("text_config") or view.target.config
    inter = int(text.get("intermediate_size") or 4 * h)
    heads, kv = layout.num_attention_heads, layout.num_key_value_heads
    head_dim = h // heads
    attn = 2 * h * (heads + 2 * kv) * head_dim + h * h
    aux = len(view.target.facts.aux_layers)
    return aux * h * h + t.num_layers * (attn + 3 * h * inter) + h * t.draft_vocab_size


def plan(p: Plan, view: PlanView) -> None:
    cfg, layout = view.cfg, view.target.layout
    t, h, vd = cfg.train, layout.hidden_size, cfg.train.draft_vocab_size
    params = draft_params(cfg, view)
    aux = len(view.target.facts.aux_layers)
    p.numbers["draft_params"] = params
    p.add(
        "draft",
        f"{t.num_layers} layer(s), fc {aux}x{h}->{h}, draft vocab {vd} of {layout.vocab_size}, "
        f"~{params / 1e6:.0f}M params, {t.ttt_steps} TTT steps",
    )
    seq = t.total_seq_len or cfg.data.max_seq_len
    draft_logits, full_logits = seq * vd * 4, seq * layout.vocab_size * 4
    p.numbers.update(teacher_logits_bytes=draft_logits, full_vocab_logits_bytes=full_logits)
    p.add(
        "teacher logits",
        f"{seq} tokens x {vd} draft vocab x fp32 = {fmt_bytes(draft_logits)} per batch (full vocab "
        f"would be {fmt_bytes(full_logits)}; {fmt_bytes(layout.vocab_size * 4)}/token)",
    )


def summary(metrics: dict[str, Any], path: Path, _cfg: RunnerConfig) -> list[str]:
    return [f"draft checkpoint: {path / 'draft'}"]


def columns(metrics: Mapping[str, float]) -> dict[str, float | None]:
    return {"train_loss": metrics.get("final_loss"), "val_loss": metrics.get("val_loss_epoch")}


STAGE = Stage(
    name="train",
    key_config=key_config,
    run=run,
    upstream=("prepare", "extract", "vocab"),
    version="1",
    libraries={"speculators": ("speculators",), "torch": ("torch",)},
    identities=("tokenizer_id", "weights_id"),
    logged={"draft": "draft", "metrics.jsonl": "train"},
    summary=summary,
    columns=columns,
    plan=plan,
)
