"""Stage `train`: an EAGLE-3 draft trained by speculators' own trainer on the extracted files.

Run alone: `python -m runner run.stages=[train]` (needs prepare, extract and vocab in the store).
Turns `cfg.train` into speculators' own train settings (runner/integrations/
speculators_settings.py: the fields its flags set), pointing them at the prepared dataset, the
hidden-state folder and the vocab mapping. One GPU, or a CPU, trains in
this process (`runner.integrations.speculators.run_training`); more GPUs train under torchrun
(`train.num_gpus`, default every GPU of `hardware`; `train.fsdp` shards), started as a managed
child process (runner/processes/process.py) whose rank 0 logs into the runner's MLflow run.

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

from runner.assets.target_facts import ModelFacts
from runner.core.environment import keyed
from runner.core.errors import StageError
from runner.core.interrupts import Interrupted
from runner.core.schema import RunnerConfig
from runner.engine.stage import EXTRACTION, ServerNeed, Stage, StageContext
from runner.integrations import SLOT_BACKEND
from runner.integrations.speculators import chain_requeue, run_training
from runner.integrations.speculators_checkpoints import TRAINING_STATE, best_checkpoint, epoch_dirs
from runner.integrations.speculators_config import command_line, mask_token_id
from runner.integrations.speculators_metrics import (
    ECHO_STEPS_ENV,
    PARAMS_FILE,
    fix_recorded_versions,
    metric_records,
    summarise,
)
from runner.integrations.speculators_settings import speculators_settings
from runner.processes.cluster import rendezvous
from runner.processes.launch import resume_hint, run_ranks
from runner.serving.hidden_states import server_args
from runner.serving.vllm_server import quiet_http_logs
from stages.train import nodes
from stages.train.draft_estimate import cpu_seconds
from stages.train.export import check_export, publish_draft
from stages.train.online import hidden_state_server
from stages.train.planning import plan
from stages.train.settings import TrainConfig, train_ranks

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
    if t["sliding_window"] == 2048 and not t["full_attention_layers"]:
        # speculators' own default, which every draft trained before these settings has.
        del t["sliding_window"], t["full_attention_layers"]
    # The draft vocab moved to the vocab section; the key reads it where it always stood.
    t["draft_vocab_size"] = cfg.vocab.draft_vocab_size
    key = {
        **{k: v for k, v in t.items() if k not in _NOT_IN_KEY},
        "aux_layers": list(facts.aux_layers),
        "device": cfg.hardware.device,
        # Every rank of every node: the batches each sees depend on the world size.
        "ranks": train_ranks(cfg) * cfg.hardware.num_nodes,
    }
    env = keyed(cfg.hardware.env)
    if env:  # what the ranks get that can change what they compute (unset: as before)
        key["env"] = env
    if len(facts.aux_layers) != 3:
        # Drafts of other than three layers exported before their config told vLLM the count
        # (runner/integrations/vllm.py, servable_draft_config) do not load in vLLM: trained anew.
        key["served_aux_count"] = True
    return key


def _read_json(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def _torchrun(
    ctx: StageContext, settings: dict[str, Any], ranks: int, attempt: int
) -> dict[str, Any]:
    """speculators' trainer on `ranks` ranks under torchrun (runner/processes/launch.py), on this
    node or,
    with hardware.num_nodes > 1, on every node through a c10d rendezvous that the other nodes
    join (stages/train/nodes.py); returns the outcome rank 0 wrote."""
    work = ctx.scratch
    slots = list(ctx.facts.train_slots)
    device = ctx.cfg.hardware.device
    env = {}
    if ctx.tracker is not None and ctx.tracker.run_id:
        # Rank 0's speculators logger attaches to the runner's run.
        env.update(MLFLOW_RUN_ID=ctx.tracker.run_id, MLFLOW_TRACKING_URI=ctx.tracker.uri)
    body = dict(settings=settings, slots=slots, work=str(work), device=device, env=env)
    nnodes = ctx.cfg.hardware.num_nodes
    rdzv = None
    if nnodes > 1:
        # A new id each attempt: a node never rejoins the rendezvous of one that failed.
        rdzv = rendezvous(ctx.cfg, f"{work.name}-{attempt}")
        request = nodes.open_request(work, body, rdzv, attempt)
        log.info(
            "[train] %d nodes x %d ranks, rendezvous at %s (hardware.rdzv_endpoint); the other "
            "nodes join from %s",
            nnodes,
            ranks,
            rdzv.endpoint,
            request,
        )
    else:
        request = work / nodes.REQUEST
        request.write_text(json.dumps(body))
    try:
        code, _stopped_by, tail = run_ranks(
            "runner.integrations.speculators_worker",
            request,
            ranks,
            work / "logs" / "train.log",
            label="train",
            stop_timeout_s=ctx.cfg.train.stop_timeout_s,
            env=env,
            echo=lambda line: "speculators.metrics" not in line,
            rendezvous=rdzv.torchrun_args() if rdzv else None,
        )
    finally:
        if rdzv is not None:
            nodes.close_request(work)
    outcome = _read_json(work / "outcome.json", None)
    if outcome is None or (code != 0 and outcome.get("status") != "stopped"):
        where = f" on {nnodes} nodes" if nnodes > 1 else ""
        raise StageError(
            f"training on {ranks * nnodes} ranks{where} failed (torchrun exit {code}); {tail}\n"
            f"{resume_hint(work, ctx.rerun_command)}" + (" (on every node)" if nnodes > 1 else "")
        )
    return outcome


def _count_attempt(work: Path, save_path: Path) -> tuple[dict[str, int], bool, int]:
    """This attempt counted in work/attempts.json (now, not at the end: an attempt killed again
    still counts), with the resume and the steps it will redo; whether it resumes, and the step
    an earlier attempt reached."""
    history = _read_json(work / "attempts.json", {"attempts": 0, "resumes": 0, "steps_redone": 0})
    epochs = epoch_dirs(save_path)
    resuming = bool(epochs)
    reached_before = _read_json(work / "progress.json", {}).get("global_step", 0)
    history["attempts"] += 1
    if resuming:
        state = _read_json(epochs[-1] / TRAINING_STATE, {})
        history["resumes"] += 1
        history["steps_redone"] += max(0, reached_before - state.get("global_step", 0))
    (work / "attempts.json").write_text(json.dumps(history))
    return history, resuming, reached_before


def _ship_beside_draft(ctx: StageContext, work: Path, save_path: Path) -> None:
    """What the artifact keeps beside the draft: every epoch's draft (train.keep_epoch_drafts),
    speculators' run config and command, the training's logs; files readable by all."""
    # Every epoch's draft (train.keep_epoch_drafts), for acceptance against tokens trained: the
    # work folder with their checkpoints is deleted once the stage is published.
    if ctx.cfg.train.keep_epoch_drafts:
        kept = epoch_dirs(save_path)
        for ep in kept:
            publish_draft(ep, ctx.out / "epochs" / ep.name, ctx)
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


def _peak_memory(work: Path) -> dict[str, float]:
    """Each rank's peak GPU memory (the plan's estimate is checked against it); {} on a CPU."""
    peaks = [_read_json(p, {}) for p in sorted(work.glob("memory_rank*.json"))]
    return {
        f"peak_gpu_{kind}_gib": max(p[kind] for p in peaks) / 2**30
        for kind in ("allocated", "reserved")
        if peaks and all(kind in p for p in peaks)
    }


def _raise_if_stopped(ctx: StageContext, outcome: dict[str, Any]) -> None:
    """A training stopped by a signal (its checkpoint saved) ends the stage as interrupted,
    with the command that resumes it."""
    if outcome.get("status") == "finished":
        return
    name = outcome.get("signal") or "SIGTERM"  # None: another rank was signalled
    raise Interrupted(
        signal.Signals[name],
        f"training was stopped by {name} at epoch {outcome.get('epoch')} step "
        f"{outcome.get('local_step')} (global step {outcome.get('global_step')}) and saved a "
        f"checkpoint. {resume_hint(ctx.scratch, ctx.rerun_command)}",
    )


def run(ctx: StageContext) -> dict[str, Any]:
    work = ctx.scratch
    save_path = work / "checkpoints"
    history, resuming, reached_before = _count_attempt(work, save_path)
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
    ranks = train_ranks(ctx.cfg)
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
            if ranks == 1 and ctx.cfg.hardware.num_nodes == 1:
                state = run_training(
                    settings, ctx.facts.train_slots, work, device=ctx.cfg.hardware.device
                )
                outcome = _read_json(work / "outcome.json", {})
                chain_requeue(state)
            else:
                outcome = _torchrun(ctx, settings, ranks, history["attempts"])
        train_s = time.time() - t0
    _raise_if_stopped(ctx, outcome)
    if (work / PARAMS_FILE).is_file():  # logged live; replayed by runs that reuse this
        shutil.copy2(work / PARAMS_FILE, ctx.out / PARAMS_FILE)
    records = metric_records(work / "metrics.jsonl")
    with open(ctx.out / "metrics.jsonl", "w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    ckpt = best_checkpoint(save_path)
    draft = publish_draft(ckpt, ctx.out / "draft", ctx)
    checked = check_export(ctx, settings, draft, records, online)
    _ship_beside_draft(ctx, work, save_path)
    return {
        **summarise(records),
        **checked,
        **_peak_memory(work),
        "checkpoint_bytes": sum(f.stat().st_size for f in draft.iterdir()),
        "ranks": ranks * ctx.cfg.hardware.num_nodes,
        **({"nodes": ctx.cfg.hardware.num_nodes} if ctx.cfg.hardware.num_nodes > 1 else {}),
        # This attempt's training alone (no server start): online against offline per epoch.
        "train_s": train_s,
        "seconds_per_epoch": train_s / ctx.cfg.train.epochs,
        **({"server_start_s": ctx.manifest["served"]["start_s"]} if online else {}),
        "resumes": history["resumes"],
        "steps_redone": history["steps_redone"],
    }


def summary(metrics: dict[str, Any], path: Path, cfg: RunnerConfig) -> list[str]:
    lines = [f"draft checkpoint: {path / 'draft'}"]
    if cfg.train.keep_epoch_drafts and (path / "epochs").is_dir():
        n = len(list((path / "epochs").iterdir()))
        lines.append(
            f"every epoch's draft ({n}): {path / 'epochs'}/<n> (eval.draft=... to measure)"
        )
    return lines


def results(metrics: Mapping[str, Any], _cfg: RunnerConfig) -> list[dict[str, Any]]:
    """What a published card shows of training: the last epoch's validation loss."""
    val = metrics.get("val_loss_epoch")
    return [] if val is None else [{"validation_loss": val}]


def figures(_metrics: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """Training and validation loss on one chart against the step (MLflow draws each metric
    on a chart of its own): the training loss as logged and as a running mean of 20 points,
    the validation loss at each epoch's end."""
    try:
        records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return {}
    train = [(r["step"], r["train/loss"]) for r in records if "train/loss" in r]
    val = [(r["step"], r["val/loss_epoch"]) for r in records if "val/loss_epoch" in r]
    if not train:
        return {}
    import matplotlib  # a second to import; only when a run logs its figures

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs, ys = zip(*train, strict=True)
    ax.plot(xs, ys, alpha=0.3, label="training loss")
    window = min(20, len(ys))
    mean = [sum(ys[max(0, i - window + 1) : i + 1]) / len(ys[max(0, i - window + 1) : i + 1])
            for i in range(len(ys))]  # fmt: skip
    ax.plot(xs, mean, label=f"training loss, running mean of {window} logged points")
    if val:
        vx, vy = zip(*val, strict=True)
        ax.plot(vx, vy, "o-", label="validation loss (epoch end)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (summed over draft positions)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return {"train/loss_curves.png": fig}


def columns(metrics: Mapping[str, float]) -> dict[str, float | None]:
    # speculators' own curves: train/loss (its last value) and val/loss_epoch.
    return {"train_loss": metrics.get("loss"), "val_loss": metrics.get("val_loss_epoch")}


STAGE = Stage(
    name="train",
    rates=Path(__file__).with_name("rates.yaml"),
    settings=TrainConfig,
    key_config=key_config,
    run=run,
    upstream=("prepare", "extract", "vocab"),
    version="1",
    libraries={"speculators": ("speculators",), "torch": ("torch",)},
    identities=("tokenizer_id", "weights_id"),
    logged={"draft": "draft", "metrics.jsonl": "train", "logs": "train/logs"},
    summary=summary,
    columns=columns,
    results=results,
    figures=figures,
    also_reads=("val/",),
    # Without an evaluation, a sweep plots and compares the validation loss.
    plotted="val_loss",
    # speculators logs train/* and val/* while training; the manifest's final_*, val_* and
    # first_loss repeat their last values.
    curves="metrics.jsonl",
    replayed_params=PARAMS_FILE,
    curve_copies=("final_", "val_", "first_loss"),
    plan=plan,
    cpu_seconds=cpu_seconds,
    # Online, training fetches states from a vLLM server (extract.mode=online).
    server=lambda cfg: (
        ServerNeed(EXTRACTION, cfg.data.max_seq_len + 1, "data.max_seq_len", key="extract.mode")
        if cfg.extract.mode == "online"
        else None
    ),
    # The work folder (checkpoints) survives a failed or interrupted run: the next one resumes.
    resumable=True,
    # On several nodes, each node after the first joins this stage's torchrun (nodes.py).
    follow=nodes.follow,
)
