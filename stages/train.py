"""Stage `train`: an EAGLE-3 draft trained by speculators' own trainer on the extracted files.

Run alone: `python -m runner run.stages=[train]` (needs prepare, extract and vocab in the store).
Turns `cfg.train` into speculators' own train settings (runner/integrations/
speculators_settings.py: the fields its flags set), pointing them at the prepared dataset, the
hidden-state folder and the vocab mapping. One GPU, or a CPU, trains in
this process (`runner.integrations.speculators.run_training`); more GPUs train under torchrun
(`train.num_gpus`, default every GPU of `hardware`; `train.fsdp` shards), started as a managed
child process (runner/process.py) whose rank 0 logs into the runner's MLflow run.

Interrupted training resumes: the work folder (checkpoints, metric records, attempts) is keyed
by the artifact key and kept until the stage succeeds; the same command continues from the
latest checkpoint (`train.checkpoint_every` adds them within an epoch). SIGINT, SIGTERM and
SIGUSR1 (Slurm's warning, through submitit) save a checkpoint at the next step boundary; the
stage then fails, publishes nothing and prints the command that resumes. Publishes `draft/`:
the checkpoint (config.json + model.safetensors in speculators' format, which vLLM serves with
`speculative_config={"method": "eagle3", ...}`), `metrics.jsonl`, and the ranks' log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runner.draft_estimate import draft_params, plan_memory
from runner.errors import StageError
from runner.integrations import SLOT_BACKEND
from runner.integrations.speculators import (
    ECHO_STEPS_ENV,
    RESUME_ONLY,
    TRAINING_STATE,
    Refused,
    best_checkpoint,
    chain_requeue,
    command_line,
    epoch_dirs,
    fix_recorded_versions,
    mask_token_id,
    metric_records,
    resolve_train_config,
    run_training,
    summarise,
)
from runner.integrations.speculators_settings import setting_key, speculators_settings
from runner.interrupts import Interrupted
from runner.launch import resume_hint, run_ranks
from runner.online import hidden_state_server, plan_online
from runner.schema import RunnerConfig
from runner.stage import EXTRACTION, Plan, PlanView, ServerNeed, Stage, StageContext
from runner.store import fmt_bytes, free_bytes
from runner.target_facts import ModelFacts, target_hub_id
from runner.vllm_server import quiet_http_logs
from stages.extract.vllm_backend import server_args

log = logging.getLogger("runner")
# Settings that change how fast or how safely training runs, not what it produces (the number
# of ranks does change it: it enters the key as "ranks").
_NOT_IN_KEY = (
    "name",
    "num_workers",
    "log_freq",
    "num_gpus",
    "cpu_processes",
    "checkpoint_every",
    "stop_timeout_s",
    "echo_steps",
)


def key_config(cfg: RunnerConfig, facts: ModelFacts) -> dict[str, Any]:
    t = dataclasses.asdict(cfg.train)
    if not t["keep_epoch_drafts"]:
        del t["keep_epoch_drafts"]  # named only when on: keys made before it stay valid
    # The draft vocab moved to the vocab section; the key reads it where it always stood.
    t["draft_vocab_size"] = cfg.vocab.draft_vocab_size
    return {
        **{k: v for k, v in t.items() if k not in _NOT_IN_KEY},
        "aux_layers": list(facts.aux_layers),
        "device": cfg.hardware.device,
        "ranks": cfg.train_ranks(),
    }


def _read_json(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def _torchrun(ctx: StageContext, settings: dict[str, Any], ranks: int) -> dict[str, Any]:
    """speculators' trainer on `ranks` ranks under torchrun (runner/launch.py); returns the
    outcome rank 0 wrote."""
    work = ctx.scratch
    request = work / "request.json"
    slots = list(ctx.facts.train_slots)
    device = ctx.cfg.hardware.device
    request.write_text(
        json.dumps(dict(settings=settings, slots=slots, work=str(work), device=device))
    )
    env = {}
    if ctx.tracker is not None and ctx.tracker.run_id:
        # Rank 0's speculators logger attaches to the runner's run.
        env.update(MLFLOW_RUN_ID=ctx.tracker.run_id, MLFLOW_TRACKING_URI=ctx.tracker.uri)
    code, _stopped_by, tail = run_ranks(
        "runner.integrations.speculators_worker",
        request,
        ranks,
        work / "logs" / "train.log",
        label="train",
        stop_timeout_s=ctx.cfg.train.stop_timeout_s,
        env=env,
        echo=lambda line: "speculators.metrics" not in line,
    )
    outcome = _read_json(work / "outcome.json", None)
    if outcome is None or (code != 0 and outcome.get("status") != "stopped"):
        raise StageError(
            f"training on {ranks} ranks failed (torchrun exit {code}); {tail}\n"
            f"{resume_hint(work, ctx.rerun_command)}"
        )
    return outcome


def run(ctx: StageContext) -> dict[str, Any]:
    work = ctx.scratch
    save_path = work / "checkpoints"
    history = _read_json(work / "attempts.json", {"attempts": 0, "resumes": 0, "steps_redone": 0})
    epochs = epoch_dirs(save_path)
    resuming = bool(epochs)
    reached_before = _read_json(work / "progress.json", {}).get("global_step", 0)
    # Counted now, not at the end: an attempt that is killed again still counts.
    history["attempts"] += 1
    if resuming:
        state = _read_json(epochs[-1] / TRAINING_STATE, {})
        history["resumes"] += 1
        history["steps_redone"] += max(0, reached_before - state.get("global_step", 0))
    (work / "attempts.json").write_text(json.dumps(history))
    for stale in (work / "outcome.json", *work.glob("memory_rank*.json")):
        stale.unlink(missing_ok=True)
    # Read by the training call (and inherited by torchrun's ranks); the job restores the
    # environment afterwards.
    os.environ[ECHO_STEPS_ENV] = "1" if ctx.cfg.train.echo_steps else "0"
    online = ctx.cfg.extract.mode == "online"
    # Online, nothing is read from disk: an empty folder, so speculators fetches every sample.
    states = work / "no_stored_states" if online else ctx.inputs["extract"].path / "hidden_states"
    if online:
        states.mkdir(exist_ok=True)
    ranks = ctx.cfg.train_ranks()
    mask = mask_token_id(ctx.facts.path, ctx.facts.vocab_size, ctx.cfg.model.trust_remote_code)
    with hidden_state_server(ctx, server_args) as server:
        settings = speculators_settings(
            ctx.cfg,
            ctx.facts,
            data_path=ctx.inputs["prepare"].path / "dataset",
            hidden_states=states,
            vocab=ctx.inputs["vocab"].path,
            save_path=save_path,
            online=server.url if server is not None else None,
        )
        if ctx.tracker is not None:
            settings["logger"] = "mlflow"
        settings["mask_token_id"] = mask
        ctx.manifest["speculators_settings"] = settings
        ctx.manifest["speculators_command"] = command_line(settings)
        if settings.get("hidden_states_backend") == SLOT_BACKEND:
            ctx.manifest["slots"] = list(ctx.facts.train_slots)
        if resuming:
            log.info(
                "[train] resuming from %s (an earlier run reached step %d)",
                save_path,
                reached_before,
            )
        t0 = time.time()
        # Online, every fetched sample is an HTTP request that its client logs at INFO.
        with quiet_http_logs() if online else contextlib.nullcontext():
            if ranks == 1:
                state = run_training(
                    settings, ctx.facts.train_slots, work, device=ctx.cfg.hardware.device
                )
                outcome = _read_json(work / "outcome.json", {})
                chain_requeue(state)
            else:
                outcome = _torchrun(ctx, settings, ranks)
        train_s = time.time() - t0
    if outcome.get("status") != "finished":
        name = outcome.get("signal") or "SIGTERM"  # None: another rank was signalled
        raise Interrupted(
            signal.Signals[name],
            f"training was stopped by {name} at epoch {outcome.get('epoch')} step "
            f"{outcome.get('local_step')} (global step {outcome.get('global_step')}) and saved a "
            f"checkpoint. {resume_hint(ctx.scratch, ctx.rerun_command)}",
        )
    records = metric_records(work / "metrics.jsonl")
    with open(ctx.out / "metrics.jsonl", "w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    ckpt = best_checkpoint(save_path)
    draft = _publish_draft(ckpt, ctx.out / "draft", ctx)
    # Every epoch's draft (train.keep_epoch_drafts), for acceptance against tokens trained: the
    # work folder with their checkpoints is deleted once the stage is published.
    if ctx.cfg.train.keep_epoch_drafts:
        kept = epoch_dirs(save_path)
        for ep in kept:
            _publish_draft(ep, ctx.out / "epochs" / ep.name, ctx)
        ctx.manifest["epoch_drafts"] = [f"epochs/{ep.name}" for ep in kept]
    for f in ("run.yaml", "train_command.txt"):
        if (save_path / f).exists():
            shutil.copy2(save_path / f, ctx.out / f)
    fix_recorded_versions(ctx.out / "train_command.txt")
    for name in ("train.log", "vllm_online.log"):
        if (work / "logs" / name).is_file():
            (ctx.out / "logs").mkdir(exist_ok=True)
            shutil.copy2(work / "logs" / name, ctx.out / "logs" / name)
    for f in ctx.out.iterdir():
        if f.is_file():
            f.chmod(0o644)  # speculators writes 0600: a draft's folder is shared
    peaks = [_read_json(p, {}) for p in sorted(work.glob("memory_rank*.json"))]
    memory = {
        f"peak_gpu_{kind}_gib": max(p[kind] for p in peaks) / 2**30
        for kind in ("allocated", "reserved")
        if peaks and all(kind in p for p in peaks)
    }
    return {
        **summarise(records),
        **memory,
        "checkpoint_bytes": sum(f.stat().st_size for f in draft.iterdir()),
        "ranks": ranks,
        # This attempt's training alone (no server start): online against offline per epoch.
        "train_s": train_s,
        "seconds_per_epoch": train_s / ctx.cfg.train.epochs,
        **({"server_start_s": ctx.manifest["served"]["start_s"]} if online else {}),
        "resumes": history["resumes"],
        "steps_redone": history["steps_redone"],
    }


def _publish_draft(ckpt: Path, draft: Path, ctx: StageContext) -> Path:
    """A checkpoint's weights and config (not its optimizer and scheduler states, which are for
    resuming) copied to `draft`, with the layer-id convention recorded in its config."""
    draft.mkdir(parents=True)
    for f in ckpt.iterdir():
        if f.is_file() and not f.name.endswith(RESUME_ONLY):
            shutil.copy2(f, draft / f.name)
    fix_recorded_versions(draft / "train_command.txt")
    # Record the layer-id convention in the draft's own config, beside speculators' fields.
    conf_path = draft / "config.json"
    conf = json.loads(conf_path.read_text())
    hub = target_hub_id(ctx.cfg)
    verifier = conf.get("speculators_config", {}).get("verifier", {})
    if hub and verifier:
        # A local path would tie the draft to this machine; the hub id loads anywhere.
        verifier["name_or_path"] = hub
    conf["eagle3_runner"] = {
        "layer_id_convention": (
            "vllm (id k = input of decoder layer k; n = final layer before norm)"
        ),
        "aux_layer_ids": list(ctx.facts.aux_layers),
        "capture_ids": list(ctx.facts.capture_ids),
        "target_num_layers": ctx.facts.num_layers,
        "target_hub_id": hub,
        "target_local_path": ctx.facts.path,
    }
    conf_path.write_text(json.dumps(conf, indent=2))
    for f in draft.iterdir():
        if f.is_file():
            f.chmod(0o644)  # safetensors and speculators write 0600: a draft is shared
    return draft


def _check_with_speculators(p: Plan, view: PlanView) -> None:
    """The settings this run will pass, resolved by the installed speculators' own TrainConfig
    (paths are placeholders: only values are checked), before any stage runs."""
    where = Path("/nonexistent/plan")
    online = "http://127.0.0.1:8000/v1" if view.cfg.extract.mode == "online" else None
    settings = speculators_settings(
        view.cfg,
        view.target.facts,
        where / "data",
        where / "hs",
        where / "vocab",
        where / "save",
        online=online,
    )
    try:
        resolve_train_config(settings, view.target.facts.train_slots)
    except Refused as exc:
        p.error(setting_key(view.cfg, exc.dest), f"speculators refuses it: {exc.message}")


def plan(p: Plan, view: PlanView) -> None:
    cfg, layout = view.cfg, view.target.layout
    if view.actions.get("train") == "run":
        _check_with_speculators(p, view)
    t, h, vd = cfg.train, layout.hidden_size, cfg.vocab.draft_vocab_size
    params = draft_params(cfg, view.target)
    aux = len(view.target.facts.aux_layers)
    p.numbers["draft_params"] = params
    if t.num_layers > layout.num_layers:
        p.error(
            "train.num_layers",
            f"a draft of {t.num_layers} layers is deeper than the target ({layout.num_layers}): "
            "it would be slower than the target it drafts for (EAGLE-3 drafts have 1 to 2)",
        )
    if t.keep_epoch_drafts and view.actions.get("train") == "run":
        # Each kept draft in bf16, next to the artifact's own and a resumable checkpoint.
        need, free = (t.epochs + 2) * params * 2, free_bytes(view.output_root)
        p.numbers["epoch_drafts_bytes"] = need
        if free is not None and need > free:
            p.error(
                "train.keep_epoch_drafts",
                f"{t.epochs} epochs' drafts need ~{fmt_bytes(need)} but {view.output_root} has "
                f"{fmt_bytes(free)} free; keep fewer (fewer train.epochs) or set it false",
            )
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
    ranks, hw = cfg.train_ranks(), cfg.hardware
    mode = "in this process" if ranks == 1 else f"torchrun, {'FSDP2' if t.fsdp else 'DDP'}"
    every = (
        f"every {t.checkpoint_every:g} epoch(s)" if t.checkpoint_every else "at each epoch's end"
    )
    what = "GPU(s)" if hw.device == "cuda" else "CPU process(es)"
    p.add(
        "training",
        f"{ranks} {what} ({mode}; train.num_gpus, train.fsdp), checkpoints {every} "
        "(train.checkpoint_every)"
        + (
            f"; every epoch's draft kept ({t.epochs} x the draft's size)"
            if t.keep_epoch_drafts
            else ""
        ),
    )
    if cfg.extract.mode == "online":
        plan_online(p, cfg)
    if hw.device != "cuda":
        return
    plan_memory(p, cfg, view.target)


def summary(metrics: dict[str, Any], path: Path, cfg: RunnerConfig) -> list[str]:
    lines = [f"draft checkpoint: {path / 'draft'}"]
    if cfg.train.keep_epoch_drafts and (path / "epochs").is_dir():
        n = len(list((path / "epochs").iterdir()))
        lines.append(
            f"every epoch's draft ({n}): {path / 'epochs'}/<n> (eval.draft=... to measure)"
        )
    return lines


def columns(metrics: Mapping[str, float]) -> dict[str, float | None]:
    # speculators' own curves: train/loss (its last value) and val/loss_epoch.
    return {"train_loss": metrics.get("loss"), "val_loss": metrics.get("val_loss_epoch")}


STAGE = Stage(
    name="train",
    key_config=key_config,
    run=run,
    upstream=("prepare", "extract", "vocab"),
    version="1",
    libraries={"speculators": ("speculators",), "torch": ("torch",)},
    identities=("tokenizer_id", "weights_id"),
    logged={"draft": "draft", "metrics.jsonl": "train", "logs": "train/logs"},
    summary=summary,
    columns=columns,
    also_reads=("val/",),
    # Without an evaluation, a sweep plots and compares the validation loss.
    plotted="val_loss",
    # speculators logs train/* and val/* while training; the manifest's final_*, val_* and
    # first_loss repeat their last values.
    curves="metrics.jsonl",
    curve_copies=("final_", "val_", "first_loss"),
    plan=plan,
    # Online, training fetches states from a vLLM server (extract.mode=online).
    server=lambda cfg: (
        ServerNeed(EXTRACTION, cfg.data.max_seq_len + 1, "data.max_seq_len")
        if cfg.extract.mode == "online"
        else None
    ),
    # The work folder (checkpoints) survives a failed or interrupted run: the next one resumes.
    resumable=True,
)
