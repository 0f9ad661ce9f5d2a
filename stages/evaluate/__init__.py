"""Stage `evaluate`: measured acceptance of the trained draft under real speculative decoding.

Run alone: `python -m runner run.stages=[evaluate]` (needs train in the store).
The runner starts a vLLM server (runner/serving/vllm_server.py, launched as `hardware.vllm` says)
that
serves the target greedily on held-out prompts (MT-bench by default), one server per setting: with
the trained draft as an EAGLE-3 speculator (k speculative tokens), without a draft (the target's
own greedy output and speed), and optionally with a randomly initialised draft of the same shape
(`eval.random_baseline`). Acceptance comes from the server's Prometheus counters (/metrics:
drafts, draft tokens, accepted tokens, accepted per position), read before and after the prompts.
Reports mean acceptance length (1 + accepted / drafts), per-position acceptance, whether every
output equals the target's own, the speed ratio, and beside them the teacher-forced accuracies
from training.
Writes `eval_table.json` (one row per prompt), `summary.json` and the vLLM logs.

This module runs the stage in named phases (the draft to serve, the servers, the target alone,
the baselines, the tables); beside it: planning.py (its plan, cost and CPU estimate), epochs.py
(the epoch chosen by serving), prompt_sets.py (which prompts), serving.py (the servers and what
they return), speed.py (the speed figures), baseline.py (a draft to beat), measures.py (the
figures) and report.py (what is shown: summary, tables, MLflow inputs, the gates).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from runner.assets.prompts import user_turns
from runner.assets.target_facts import ModelFacts
from runner.core.errors import StageError
from runner.core.schema import RunnerConfig
from runner.core.store import damage
from runner.engine.stage import DRAFT, ServerNeed, Stage, StageContext
from runner.integrations.versions import VLLM_DISTS, versions
from runner.serving.vllm_server import shell_command
from stages.evaluate import baseline
from stages.evaluate.baseline import against_baseline
from stages.evaluate.epochs import CURVES, _choose_epoch, choosing_epoch
from stages.evaluate.heldout import HELDOUT
from stages.evaluate.measures import (
    MISMATCH,
    acceptance,
    divergence,
    identity_counts,
    per_set,
    prompt_interval,
    proven,
    rechecked,
    report_mismatches,
    teacher_forced,
    with_verdict,
)
from stages.evaluate.planning import (
    _draft_content,
    _weights_per_gpu,
    check_target,
    cpu_fit,
    cpu_seconds,
    plan,
    speed_repeats,
)
from stages.evaluate.prompt_sets import prompt_sets, prompt_sources
from stages.evaluate.report import (
    columns,
    figures,
    gates,
    inputs,
    results,
    served_draft,
    summary,
    tables,
    write_tables,
)
from stages.evaluate.serving import (
    gpu_memory_gib,
    random_draft,
    serve_again,
    serve_reading,
    serve_sets,
    serve_together,
    server_args,
    together,
    tokens_per_s,
)
from stages.evaluate.settings import EvalConfig
from stages.evaluate.speed import kv_figures, speed_figures

log = logging.getLogger("runner")
_NOT_IN_KEY = ("name", "timeout_s")


def key_config(cfg: RunnerConfig, facts: ModelFacts) -> dict[str, Any]:
    e = dataclasses.asdict(cfg.eval)
    if not e["speed_check"]:
        del e["speed_check"]  # off: the same measurement as before the setting existed
    if e["speed_servers"] == "auto":
        del e["speed_servers"]  # (likewise)
    if not e["concurrency"]:
        del e["concurrency"]  # (likewise)
    if not speed_repeats(cfg):
        del e["speed_pass_s"]  # no speed measured (a CPU's default): the passes' length is moot
    if cfg.eval.draft:
        e["draft"] = _draft_content(cfg.eval.draft)
    if choosing_epoch(cfg):
        e["choose_epoch"] = True
    else:
        del e["choose_epoch"], e["choose_epoch_prompts"]  # (likewise)
    if cfg.eval.baseline_draft:
        # A folder or a run's draft by what is served, wherever it lies; a hub id by its name
        # (the same before and after it is downloaded).
        given = cfg.eval.baseline_draft
        folder, _ = (None, "") if baseline.is_hub_id(given) else baseline.locate(cfg)
        e["baseline_draft"] = _draft_content(str(folder)) if folder else given
    else:
        del e["baseline_draft"]  # unset: the same measurement as before the setting existed
    return {
        **{k: v for k, v in e.items() if k not in _NOT_IN_KEY},
        "weights": facts.weights_id,
        "dtype": cfg.hardware.dtype,
        # Held-out prompts are whole conversations up to a user turn since this mark; the
        # first-turn ones measured before are another measurement.
        **({"heldout": "multi-turn"} if HELDOUT in prompt_sources(cfg) else {}),
        # Measured on a server the runner did not start: another measurement than its own.
        **({"endpoint": cfg.hardware.vllm.endpoint} if cfg.hardware.vllm.endpoint else {}),
        # Another kernel, KV cache dtype, server flag or variable is another measurement
        # (unset: as before they were).
        **cfg.hardware.server_key(),
    }


def _reads(cfg: RunnerConfig) -> tuple[str, ...]:
    """The draft's training; with the held-out set, what prepare (and regenerate) read."""
    reads = () if cfg.eval.draft else ("train",)
    if HELDOUT in prompt_sources(cfg):
        reads += ("prepare",)
        if cfg.regenerate.backend != "none":
            reads += ("regenerate",)
    return reads


def run(ctx: StageContext) -> dict[str, Any]:
    """Serve the draft on every prompt set; then, as configured, the target alone (identity and
    speed), a baseline draft and a random one; write the tables and the summary."""
    cfg = ctx.cfg
    e = cfg.eval
    sets = prompt_sets(ctx)
    first = next(iter(sets))  # the run's own figures (and objective); the others by name
    train_art = ctx.inputs.get("train")  # None for a draft trained elsewhere (eval.draft)
    draft = _draft_to_serve(ctx, train_art, first, sets[first])
    logs = ctx.scratch / "logs"  # copied into the artifact at the end; kept if the stage fails
    _record_serving(ctx, draft, sets)
    existing = cfg.hardware.vllm.endpoint is not None
    comparing = e.compare_target and not existing
    repeats = speed_repeats(cfg) if comparing else 0
    paired, why = together(cfg, _weights_per_gpu(cfg, ctx.facts), gpu_memory_gib(cfg))
    target: dict[str, dict] = {}
    if comparing and paired:
        log.info("[evaluate] both servers at once, their timed passes alternating (%s)", why)
        start_s, spec, target = serve_together(cfg, ctx.facts, draft, sets, logs, repeats)
    else:
        start_s, spec = serve_sets(
            cfg, ctx.facts, draft, sets, "draft", logs, speed_repeats=repeats
        )
    metrics: dict[str, Any] = {"server_start_s": start_s}
    if "chosen_epoch" in ctx.manifest:
        metrics["chosen_epoch"] = ctx.manifest["chosen_epoch"]["epoch"]
    if repeats:
        metrics["speed_servers_together"] = int(comparing and paired)
    metrics.update(_acceptance_metrics(spec, sets, first))
    identical: dict[str, list[bool | None]] = {n: [None] * len(p) for n, p in sets.items()}
    differs: dict[str, list[dict[str, Any] | None]] = {n: [None] * len(p) for n, p in sets.items()}
    # A server that already runs (hardware.vllm.endpoint) serves one configuration, the draft's:
    # the target alone and a random draft would need servers of their own (the plan says so).
    if existing:
        ctx.manifest["served_by"] = cfg.hardware.vllm.endpoint
    if comparing:
        target = target or _target_alone(ctx, spec, sets, logs, repeats)
        for name, result in target.items():
            pre = "" if name == first else f"{name}/"
            rows = zip(
                spec[name]["token_ids"], result["token_ids"], result["likeliest"], strict=True
            )
            rescored = result.get("rescored", {})
            differs[name] = [
                proven(divergence(a, b, t2, e.near_tie_gap), rescored.get(i))
                for i, (a, b, t2) in enumerate(rows)
            ]
            identical[name] = [d is None for d in differs[name]]
            if result.get("read_by") != "prefill":  # a reading generates nothing
                metrics[f"{pre}target_tokens_per_s"] = tokens_per_s(result)
        if repeats:
            metrics.update(speed_figures(ctx, spec, target, sets, first, repeats))
        differs = _again(cfg, ctx.facts, draft, sets, differs, target, logs)
        metrics.update(identity_counts(differs))
        report_mismatches(differs)
    if e.baseline_draft and not existing:
        metrics.update(against_baseline(ctx, spec, target, sets, first, logs, repeats))
    if e.random_baseline and not existing and train_art is not None:
        # On the first set only: a floor, not a figure to compare across sets.
        rand = random_draft(train_art.manifest, ctx.scratch / "random_draft")
        _, rnd = serve_sets(cfg, ctx.facts, rand, {first: sets[first]}, "random_draft", logs)
        for k, v in acceptance(rnd[first]["counters"]).items():
            metrics[f"random_{k}"] = v
    if train_art is not None:
        train_metrics = train_art.manifest.get("metrics", {})
        metrics.update(teacher_forced(train_metrics, e.num_speculative_tokens))
    write_tables(ctx, sets, spec, identical, differs)
    if logs.is_dir():  # none with an existing server: its log is on its machine
        shutil.copytree(logs, ctx.out / "logs")
    metrics.update(kv_figures(ctx.out / "logs"))
    (ctx.out / "summary.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def _draft_to_serve(
    ctx: StageContext, train_art: Any, first: str, first_prompts: list[Any]
) -> Path:
    """The draft this evaluation serves: eval.draft, or the trained one (the epoch chosen by
    serving, when asked), hashed in full first: a bit flip would be served silently."""
    if train_art is None:
        return Path(ctx.cfg.eval.draft or "").expanduser().resolve()
    chosen = "draft"
    if choosing_epoch(ctx.cfg) and train_art.manifest.get("epoch_drafts"):
        chosen, _ = _choose_epoch(ctx, train_art, first, first_prompts, ctx.scratch / "logs")
    wrong = damage(train_art, full=True, under=f"{chosen}/")
    if wrong is not None:
        raise StageError(
            f"the draft in {train_art.path} is damaged ({wrong}); refusing to serve it. Run "
            "with run.force=[train] to train it again, or delete that folder"
        )
    return train_art.path / chosen


def _record_serving(ctx: StageContext, draft: Path, sets: dict[str, list[Any]]) -> None:
    """served.json and the manifest: what was served, how, and by which engine."""
    cfg = ctx.cfg
    ctx.manifest["served"] = {
        "target": ctx.facts.path,
        "draft": str(draft),
        # What a user pastes to serve it as measured (publish rewrites the draft's path).
        "serve_command": shell_command(cfg, ctx.facts.path, server_args(cfg, draft)),
        # The settings that decide acceptance (attention kernels, KV cache dtype, ...), and
        # the engine that served them.
        "serving": cfg.hardware.vllm.serving(),
        "vllm": versions({"vllm": VLLM_DISTS})["vllm"],
    }
    (ctx.out / "served.json").write_text(json.dumps(ctx.manifest["served"], indent=2))
    ctx.manifest["prompt_sets"] = {name: len(p) for name, p in sets.items()}


def _acceptance_metrics(
    spec: dict[str, dict], sets: dict[str, list[Any]], first: str
) -> dict[str, Any]:
    """Each set's acceptance, interval and counts; the first set's are the run's own, another
    set's carry its name as a prefix."""
    metrics: dict[str, Any] = {}
    for name, result in spec.items():
        pre = "" if name == first else f"{name}/"
        measured = acceptance(result["counters"])
        if name != first:
            measured = per_set(measured)
        metrics.update({f"{pre}{k}": v for k, v in measured.items()})
        metrics.update({f"{pre}{k}": v for k, v in prompt_interval(result["per_prompt"]).items()})
        metrics[f"{pre}prompts"] = len(sets[name])
        if name == HELDOUT:
            metrics[f"{pre}multi_turn_prompts"] = sum(user_turns(q) > 1 for q in sets[name])
        metrics[f"{pre}generated_tokens"] = sum(len(t) for t in result["token_ids"])
        metrics[f"{pre}spec_tokens_per_s"] = tokens_per_s(result)
    return metrics


def _target_alone(
    ctx: StageContext,
    spec: dict[str, dict],
    sets: dict[str, list[Any]],
    logs: Path,
    repeats: int,
) -> dict[str, dict]:
    """The target alone on the served outputs: read in one prefill each (eval.identity=prefill)
    or generated again, with its speed passes when timed."""
    cfg = ctx.cfg
    if cfg.eval.identity == "prefill":
        _, target = serve_reading(cfg, ctx.facts, spec, sets, logs, speed_repeats=repeats)
        return target
    _, target = serve_sets(
        cfg,
        ctx.facts,
        None,
        sets,
        "target",
        logs,
        likeliest=True,
        speed_repeats=repeats,
        served={name: result["token_ids"] for name, result in spec.items()},
    )
    return target


def _again(
    cfg: RunnerConfig,
    facts: ModelFacts,
    draft: Path,
    sets: dict[str, list[Any]],
    differs: dict[str, list[dict[str, Any] | None]],
    target: dict[str, dict],
    logs: Path,
) -> dict[str, list[dict[str, Any] | None]]:
    """Each proven mismatch served again alone on a fresh draft server (serving.serve_again):
    one that follows the target's path there is transient (measures.rechecked)."""
    which: dict[str, list[int]] = {}
    for name, i, _ in with_verdict(differs, MISMATCH):
        which.setdefault(name, []).append(i)
    if not which:
        return differs
    again = serve_again(cfg, facts, draft, sets, which, logs)
    out = {name: list(rows) for name, rows in differs.items()}
    for name, got in again.items():
        for i, tokens in got.items():
            out[name][i] = rechecked(out[name][i], tokens, target[name]["token_ids"][i])
    return out


STAGE = Stage(
    name="evaluate",
    rates=Path(__file__).with_name("rates.yaml"),
    key_config=key_config,
    run=run,
    upstream=("train",),
    version="1",
    libraries={"vllm": VLLM_DISTS},
    identities=("tokenizer_id", "weights_id"),
    logged={
        "eval_table.json": "evaluate",
        "summary.json": "evaluate",
        "served.json": "evaluate",
        "logs": "evaluate/logs",
    },
    summary=summary,
    columns=columns,
    tables=tables,
    figures=figures,
    server=lambda cfg: ServerNeed(
        DRAFT,
        cfg.eval.max_model_len,
        "eval.max_model_len",
        k=cfg.eval.num_speculative_tokens,
        k_key="eval.num_speculative_tokens",
        key="eval.draft" if cfg.eval.draft else "run.stages",
    ),
    reads=_reads,
    objective="acceptance_length",
    plotted="acceptance_length",
    plotted_floor=(1.0, "1.0: nothing accepted"),
    results=results,
    plan=plan,
    check_target=check_target,
    cpu_seconds=cpu_seconds,
    cpu_fit=cpu_fit,
    gate=gates,
    settings=EvalConfig,
    section="eval",
    curves=CURVES,
    curves_live=False,
    served_draft=served_draft,
    inputs=inputs,
)
