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

This module runs the stage and plans it; beside it: prompt_sets.py (which prompts), serving.py
(the servers and what they return), measures.py (the figures) and report.py (what is shown).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runner.assets.prompts import shown, user_turns
from runner.assets.sources import load_prompt_sets
from runner.assets.target_facts import ModelFacts, target_context, weight_bytes
from runner.core.errors import ConfigError, StageError
from runner.core.schema import RunnerConfig
from runner.core.store import damage
from runner.engine import costs
from runner.engine.stage import DRAFT, Plan, PlanView, ServerNeed, Stage, StageContext
from runner.integrations.versions import VLLM_DISTS, versions
from runner.serving.vllm_server import kv_capacity, shell_command
from stages.evaluate import baseline
from stages.evaluate.draft_fit import misfits
from stages.evaluate.heldout import HELDOUT, plan_room
from stages.evaluate.measures import (
    MISMATCH,
    acceptance,
    by_concurrency,
    crossover,
    divergence,
    gate,
    identity_counts,
    paired_noise,
    prompt_cells,
    prompt_interval,
    proven,
    rechecked,
    report_mismatches,
    speed_metrics,
    teacher_forced,
    transient,
    with_verdict,
)
from stages.evaluate.prompt_sets import check_prompt_room, prompt_sets, prompt_sources
from stages.evaluate.report import columns, figures, results, set_names, summary, tables
from stages.evaluate.serving import (
    draft_is_mla,
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
from stages.evaluate.speed_check import agreement

log = logging.getLogger("runner")
# Series as step records (Stage.curves): the speed figures by concurrency level (the level as
# step) and each kept epoch's acceptance (the epoch as step).
CURVES = "curves.jsonl"
CURVED = (
    "gain",
    "draft_tok_s",
    "target_tok_s",
    "draft_tok_s_per_stream",
    "target_tok_s_per_stream",
)
_NOT_IN_KEY = ("name", "timeout_s")


def _draft_content(folder: str) -> str | None:
    """sha256 of a draft folder's config and weights (eval.draft: what is served, wherever it
    lies); None if it is not a draft folder (the plan says so)."""
    import hashlib

    root = Path(folder).expanduser()
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        try:
            with open(root / name, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 24), b""):
                    h.update(block)
        except OSError:
            return None
    return h.hexdigest()


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
            metrics.update(_speed_figures(ctx, spec, target, sets, first, repeats))
        differs = _again(cfg, ctx.facts, draft, sets, differs, target, logs)
        metrics.update(identity_counts(differs))
        report_mismatches(differs)
    if e.baseline_draft and not existing:
        metrics.update(_against_baseline(ctx, spec, target, sets, first, logs, repeats))
    if e.random_baseline and not existing and train_art is not None:
        # On the first set only: a floor, not a figure to compare across sets.
        rand = random_draft(train_art.manifest, ctx.scratch / "random_draft")
        _, rnd = serve_sets(cfg, ctx.facts, rand, {first: sets[first]}, "random_draft", logs)
        for k, v in acceptance(rnd[first]["counters"]).items():
            metrics[f"random_{k}"] = v
    if train_art is not None:
        train_metrics = train_art.manifest.get("metrics", {})
        metrics.update(teacher_forced(train_metrics, e.num_speculative_tokens))
    _write_tables(ctx, sets, spec, identical, differs)
    if logs.is_dir():  # none with an existing server: its log is on its machine
        shutil.copytree(logs, ctx.out / "logs")
    metrics.update(_kv_capacity(ctx.out / "logs"))
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
            measured = _per_set(measured)
        metrics.update({f"{pre}{k}": v for k, v in measured.items()})
        metrics.update({f"{pre}{k}": v for k, v in prompt_interval(result["per_prompt"]).items()})
        metrics[f"{pre}prompts"] = len(sets[name])
        if name == HELDOUT:
            metrics[f"{pre}multi_turn_prompts"] = sum(user_turns(q) > 1 for q in sets[name])
        metrics[f"{pre}generated_tokens"] = sum(len(t) for t in result["token_ids"])
        metrics[f"{pre}spec_tokens_per_s"] = tokens_per_s(result)
    return metrics


def _per_set(measured: dict[str, Any]) -> dict[str, Any]:
    """The figures a set other than the run's own keeps (and a baseline draft's): the
    acceptance length, the draft acceptance rate and each position's."""
    keep = ("acceptance_length", "draft_acceptance_rate")
    return {k: v for k, v in measured.items() if k in keep or "_pos_" in k}


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


def _speed_figures(
    ctx: StageContext,
    spec: dict[str, dict],
    target: dict[str, dict],
    sets: dict[str, list[Any]],
    first: str,
    repeats: int,
) -> dict[str, Any]:
    """The speed-up from the timed passes (speed.json keeps every repeat), the independent
    client's agreement, and the gain by concurrency (concurrency.json and its curves)."""
    metrics: dict[str, Any] = {}
    speeds = {"draft": spec[first]["speed"], "target": target[first]["speed"]}
    (ctx.out / "speed.json").write_text(json.dumps(speeds, indent=1))  # every repeat
    metrics.update(speed_metrics(speeds["draft"], speeds["target"]))
    if "check" in speeds["draft"]:
        check = speed_metrics(speeds["draft"]["check"], speeds["target"]["check"])
        kinds = ("c1", "batch")
        metrics.update(
            agreement(
                {k: metrics[f"speedup_{k}"] for k in kinds},
                {k: check[f"speedup_{k}"] for k in kinds},
                paired_noise(speeds),
            )
        )
    for server, speed in speeds.items():
        if speed.get("compile_cache"):
            metrics[f"{server}_compile_cold"] = int(speed["compile_cache"] == "cold")
    metrics["speed_repeats"] = repeats
    metrics["speed_batch"] = len(sets[first])
    levels = by_concurrency(metrics, list(ctx.cfg.eval.concurrency))
    if levels:
        metrics.update(crossover(levels))
        (ctx.out / "concurrency.json").write_text(json.dumps(levels, indent=1))
        # One series per figure with the level as its step: MLflow draws each as one chart of
        # gain (or tokens/s) against concurrency.
        with open(ctx.out / CURVES, "a") as fh:  # after the epochs' curves, if any
            fh.write(
                "".join(
                    json.dumps(
                        {
                            "step": r["concurrency"],
                            **{f"evaluate/{k}_by_concurrency": r[k] for k in CURVED},
                        }
                    )
                    + "\n"
                    for r in levels
                )
            )
    return metrics


def _against_baseline(
    ctx: StageContext,
    spec: dict[str, dict],
    target: dict[str, dict],
    sets: dict[str, list[Any]],
    first: str,
    logs: Path,
    repeats: int,
) -> dict[str, Any]:
    """eval.baseline_draft served on the same prompts: its figures, the paired difference per
    set with its interval and verdict (baseline.json), and its speed against the target's."""
    cfg = ctx.cfg
    metrics: dict[str, Any] = {}
    theirs = baseline.fetch(cfg)
    _, base = serve_sets(cfg, ctx.facts, theirs, sets, "baseline", logs, speed_repeats=repeats)
    ctx.manifest["baseline"] = {"draft": str(theirs), "given": cfg.eval.baseline_draft}
    rows = baseline.compare(
        {n: spec[n]["per_prompt"] for n in sets}, {n: base[n]["per_prompt"] for n in sets}
    )
    for name, result in base.items():
        pre = "" if name == first else f"{name}/"
        measured = _per_set(acceptance(result["counters"]))
        measured.update(prompt_interval(result["per_prompt"]))
        metrics.update({f"baseline/{pre}{k}": v for k, v in measured.items()})
    verdicts = {baseline.BETTER: 1, baseline.SAME: 0, baseline.WORSE: -1}
    for row in rows:
        pre = "" if row["set"] == first else f"{row['set']}/"
        for k in ("difference", "difference_ci_low", "difference_ci_high"):
            metrics[f"vs_baseline/{pre}{k}"] = row[k]
        metrics[f"vs_baseline/{pre}verdict"] = verdicts[row["verdict"]]
    if repeats and target:
        # Timed after the run's own draft and the target: against the target's timings.
        speed = speed_metrics(base[first]["speed"], target[first]["speed"])
        metrics.update({f"baseline/{k}": v for k, v in speed.items()})
        levels = by_concurrency(speed, list(cfg.eval.concurrency))
        if levels and (ctx.out / "concurrency.json").is_file():
            ours = json.loads((ctx.out / "concurrency.json").read_text())
            theirs_by = {r["concurrency"]: r for r in levels}
            for r in ours:
                if r["concurrency"] in theirs_by:
                    b = theirs_by[r["concurrency"]]
                    r["baseline_gain"] = b["gain"]
                    r["baseline_tok_s_per_stream"] = b["draft_tok_s_per_stream"]
            (ctx.out / "concurrency.json").write_text(json.dumps(ours, indent=1))
    (ctx.out / "baseline.json").write_text(json.dumps(rows, indent=1))
    return metrics


def _write_tables(
    ctx: StageContext,
    sets: dict[str, list[Any]],
    spec: dict[str, dict],
    identical: dict[str, list[bool | None]],
    differs: dict[str, list[dict[str, Any] | None]],
) -> None:
    """identity.json (each divergence with its proof) and eval_table.json (one row a prompt)."""
    identity = [
        {"set": name, "index": i, "prompt": shown(sets[name][i], 200), **d}
        for name in sets
        for i, d in enumerate(differs[name])
        if d is not None
    ]
    (ctx.out / "identity.json").write_text(json.dumps(identity, indent=1))
    table = [
        {
            "set": name,
            "index": i,
            "prompt": shown(p, 300),
            "user_turns": user_turns(p),
            "prompt_tokens": spec[name]["prompt_tokens"][i],
            "new_tokens": len(spec[name]["token_ids"][i]),
            "identical_to_target": identical[name][i],
            "differs": (differs[name][i] or {}).get("verdict"),
            **prompt_cells(spec[name]["per_prompt"], i),
            "output": spec[name]["texts"][i],
        }
        for name, prompts in sets.items()
        for i, p in enumerate(prompts)
    ]
    (ctx.out / "eval_table.json").write_text(json.dumps(table, indent=1))


def _kv_capacity(logs: Path) -> dict[str, float]:
    """Each server's KV capacity as vLLM's own start-up line states it (tokens, and requests of
    eval.max_model_len at once), and the share of the target's that the draft costs: the
    draft's cache and buffers take memory the target would give its KV cache, which is why
    past some concurrency speculation stops paying."""
    out: dict[str, float] = {}
    for label in ("draft", "target"):
        try:
            found = kv_capacity((logs / f"vllm_{label}.log").read_text(errors="replace"))
        except OSError:
            continue
        for k, v in (found or {}).items():
            out[f"{label}_{k}"] = v
    if out.get("target_kv_cache_tokens") and "draft_kv_cache_tokens" in out:
        out["kv_cost"] = 1 - out["draft_kv_cache_tokens"] / out["target_kv_cache_tokens"]
    return out


def choosing_epoch(cfg: RunnerConfig) -> bool:
    """eval.choose_epoch, or (null) whether training keeps every epoch's draft."""
    on = cfg.eval.choose_epoch
    return bool(cfg.train.keep_epoch_drafts if on is None else on) and not cfg.eval.draft


def _epoch_number(rel: str) -> int:
    """The epoch (from 1) whose end a kept draft is: speculators numbers its folders from 0."""
    return int(Path(rel).name) + 1


def _choose_epoch(
    ctx: StageContext, train_art: Any, first: str, prompts: list[Any], logs: Path
) -> tuple[str, dict[str, Any]]:
    """Serve each kept epoch's draft on the first eval.choose_epoch_prompts prompts of the first
    set; the best acceptance length wins, a tie (to 3 decimals) going to the earlier epoch.
    Writes epochs.json, and curves with the epoch as step; returns the chosen draft's folder
    (relative to the train artifact) and the record of the choice."""
    cfg = ctx.cfg
    subset = {first: prompts[: cfg.eval.choose_epoch_prompts]}
    rows = []
    for rel in sorted(train_art.manifest["epoch_drafts"], key=_epoch_number):
        n = _epoch_number(rel)
        wrong = damage(train_art, full=True, under=f"{rel}/")
        if wrong is not None:
            raise StageError(f"epoch {n}'s draft in {train_art.path} is damaged ({wrong})")
        _, got = serve_sets(cfg, ctx.facts, train_art.path / rel, subset, f"epoch{n}", logs)
        measured = acceptance(got[first]["counters"])
        rows.append(
            {
                "epoch": n,
                "draft": rel,
                "acceptance_length": measured["acceptance_length"],
                **prompt_interval(got[first]["per_prompt"]),
            }
        )
    best = max(rows, key=lambda r: (round(r["acceptance_length"], 3), -r["epoch"]))
    figures = ", ".join(f"{r['epoch']}: {r['acceptance_length']:.3f}" for r in rows)
    choice = {
        "epoch": best["epoch"],
        "draft": best["draft"],
        "epochs": len(rows),
        "prompts": len(subset[first]),
        "set": first,
        "why": f"the best served acceptance length on the first {len(subset[first])} {first} "
        f"prompts (epoch {figures})",
    }
    log.info("[evaluate] epoch %d of %d chosen: %s", best["epoch"], len(rows), choice["why"])
    ctx.manifest["chosen_epoch"] = choice
    (ctx.out / "epochs.json").write_text(json.dumps(rows, indent=1))
    with open(ctx.out / CURVES, "a") as fh:
        for r in rows:
            fh.write(
                json.dumps(
                    {"step": r["epoch"], "evaluate/epoch_acceptance_length": r["acceptance_length"]}
                )
                + "\n"
            )
    return best["draft"], choice


def inputs(metrics: Mapping[str, Any], cfg: RunnerConfig, path: Path) -> list[dict[str, Any]]:
    """The prompt sets as MLflow run inputs (context evaluation), each with its prompts (the
    text shown in the per-prompt table, its user turns and tokens) as the dataset's rows."""
    try:
        served = json.loads((path / "eval_table.json").read_text())
    except (OSError, ValueError):
        served = []
    found = []
    for i, (name, source) in enumerate(zip(set_names(cfg), prompt_sources(cfg), strict=True)):
        pre = "" if i == 0 else f"{name}/"
        if f"{pre}prompts" in metrics:
            found.append(
                {
                    "name": name,
                    "source": source,
                    "digest": f"{path.name}-{name}",
                    "context": "evaluation",
                    "rows": metrics[f"{pre}prompts"],
                    "table": [
                        {k: r.get(k) for k in ("index", "prompt", "user_turns", "prompt_tokens")}
                        for r in served
                        if r.get("set") == name
                    ],
                }
            )
    return found


def served_draft(path: Path) -> Path | None:
    """The draft an evaluation served (the run's, or the epoch it chose), from its manifest."""
    try:
        return Path(json.loads((path / "manifest.json").read_text())["served"]["draft"])
    except (OSError, ValueError, KeyError):
        return None


def _weights_per_gpu(cfg: RunnerConfig, facts: ModelFacts) -> float | None:
    """The target's weights on each GPU: its folder's weight files over the tensor-parallel
    size (None where the folder holds none that are known)."""
    files = [f for f in Path(facts.path).glob("*") if f.suffix in (".safetensors", ".bin", ".pt")]
    total = sum(f.stat().st_size for f in files)
    return total / cfg.hardware.tensor_parallel_size if total else None


def speed_repeats(cfg: RunnerConfig) -> int:
    """eval.speed_repeats, or its default: 5 on a GPU, none on a CPU (vLLM's CPU build runs
    speculative decoding slower than the target alone: its ratio says nothing about serving)."""
    if cfg.eval.speed_repeats is not None:
        return cfg.eval.speed_repeats
    return 5 if cfg.hardware.device == "cuda" else 0


def cost(view: PlanView) -> costs.Cost | None:
    """The evaluation's wall time and GPU-hours: its servers' starts (the draft-served one, the
    target alone with eval.compare_target, one per epoch with eval.choose_epoch) plus the
    generation on warm servers, from runner/engine/rates.yaml; the same with more boxes (it runs on
    one)."""
    cfg = view.cfg
    found = costs.first_scaled(
        [r for r in costs.rows("evaluate") if r["model"] == cfg.model.name],
        cfg.hardware.gpu_kind,
        "generate_s",
        is_time=True,
    )
    if found is None:
        return None
    row, (gen, source, est) = found
    # Choosing the epoch serves each kept epoch's draft on its own server first; its few prompts
    # cost little beside the start.
    servers = 1 + bool(cfg.eval.compare_target) + (cfg.train.epochs if choosing_epoch(cfg) else 0)
    wall = servers * float(row["start_s"]) + gen
    return costs.Cost(
        "evaluation",
        wall,
        wall * cfg.hardware.num_gpus / 3600,
        f"{servers} server start(s) of {costs.fmt_hours(float(row['start_s']))} + "
        f"{costs.fmt_hours(gen)} generating [{source}]",
        est,
    )


def check_target(cfg: RunnerConfig, target: Any) -> None:
    """Settings that contradict each other across sections, refused before anything loads."""
    if cfg.eval.choose_epoch and not cfg.eval.draft and cfg.train.epochs < 2:
        raise ConfigError(
            "eval.choose_epoch",
            f"chooses among the epochs' drafts, and train.epochs={cfg.train.epochs} makes one; "
            "raise train.epochs or leave eval.choose_epoch unset",
        )


def cpu_seconds(cfg: RunnerConfig, work: Any) -> float:
    """The evaluation on this CPU: each server's start and first requests, then every set on
    the draft-served server (its prompts prefilled, its tokens decoded), the target alone
    reading each served output in one prefill (eval.identity=prefill) or generating it again,
    the baselines as the draft. Prefill and decode run at the efficiencies against the probe
    measured on the default (this stage's rates.yaml, `cpu`), prompts at their sets' measured
    lengths."""
    from runner.engine.cpu_speed import cpu_rate

    r, e = cpu_rate("evaluate"), cfg.eval
    if e.draft is None and cfg.hardware.vllm.endpoint:
        return 0.0
    lengths = r.get("prompt_tokens") or {}
    flop = 2.0 * work.shape.forward_params
    prefill = work.speed.target_gflops * 1e9 * float(r.get("prefill_efficiency", 0.37)) / flop
    decode = work.speed.target_gflops * 1e9 * float(r.get("decode_efficiency", 0.06)) / flop
    prompt = sum(e.num_prompts * float(lengths.get(n, 200)) for n in e.prompts)
    new = len(e.prompts) * e.num_prompts * e.max_new_tokens
    served = prompt / prefill + new / decode  # one server's pass over every set
    servers, passes = 1, served
    if e.compare_target:
        servers += 1
        passes += (prompt + new) / prefill if e.identity == "prefill" else served
    if e.baseline_draft:
        servers, passes = servers + 1, passes + served
    if e.random_baseline:  # the first set only
        servers, passes = servers + 1, passes + served / max(1, len(e.prompts))
    if choosing_epoch(cfg):
        servers += cfg.train.epochs
    start = float(r.get("start_s", 60.0)) + float(r.get("warm_s", 40.0))
    return servers * start + passes


# Under run.time_budget: prompts a set in steps of this, never fewer than MIN_PROMPTS.
PROMPTS_STEP = 10
MIN_PROMPTS = 20


def cpu_fit(cfg: RunnerConfig, seconds: float, estimate: Any) -> tuple[RunnerConfig, str | None]:
    """Fewer prompts a set (eval.num_prompts, in steps of PROMPTS_STEP, not below MIN_PROMPTS)
    until the evaluation's CPU estimate is at most `seconds` (run.time_budget's share)."""
    asked = n = cfg.eval.num_prompts

    def at(k: int) -> RunnerConfig:
        return dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, num_prompts=k))

    while n > MIN_PROMPTS and estimate(at(n)) > seconds:
        n = max(MIN_PROMPTS, (n - 1) // PROMPTS_STEP * PROMPTS_STEP)
    if n == asked:
        return cfg, None
    return at(n), (
        f"evaluation: {n} prompts a set instead of {asked} (~{estimate(at(n)) / 60:.1f} min "
        f"against ~{estimate(cfg) / 60:.1f}; set eval.num_prompts to choose)"
    )


def plan(p: Plan, view: PlanView) -> None:
    cfg = view.cfg
    if view.actions.get("evaluate") != "run":
        return
    if cfg.hardware.device == "cuda" and (estimate := cost(view)):
        p.add_cost("evaluate", estimate, estimate)
    if cfg.eval.compare_target and not cfg.hardware.vllm.endpoint and speed_repeats(cfg):
        w = weight_bytes(view.target.layout, view.target.config, cfg.model.weights_gib)
        per_gpu = w.bytes / cfg.hardware.tensor_parallel_size if w.certain else None
        paired, why = together(cfg, per_gpu, gpu_memory_gib(cfg))
        how = (
            "both servers at once, each with half the memory, their timed passes alternating"
            if paired
            else "the draft-served server, then the target alone"
        )
        p.add(
            "speed",
            f"{speed_repeats(cfg)} warm repeats at concurrency 1 and at batch, each pass "
            + (
                f"at least {cfg.eval.speed_pass_s:g} s (eval.speed_pass_s)"
                if cfg.eval.speed_pass_s > 0
                else "one round of the prompts (eval.speed_pass_s=0)"
            )
            + f"; {how} ({why}; "
            "eval.speed_servers)"
            + (", checked by a second client (eval.speed_check)" if cfg.eval.speed_check else "")
            + (
                f"; and at {cfg.eval.concurrency} closed-loop streams (eval.concurrency)"
                if cfg.eval.concurrency
                else ""
            ),
        )
    if cfg.eval.concurrency and not speed_repeats(cfg):
        p.warn(
            "eval.concurrency",
            "no speed is measured here (eval.speed_repeats is 0 on a CPU by default, or the "
            "target is not compared): set eval.speed_repeats to time the levels",
        )
    for row in costs.rows("serving"):
        if row["model"] == cfg.model.name and row["gpu"] == cfg.hardware.gpu_kind:
            gains = ", ".join(f"{g}x at {n}" for n, g in row["gain"].items())
            p.add(
                "KV capacity",
                f"expect the draft to cost about {1 - row['kv_draft'] / row['kv_target']:.0%} "
                f"of the KV cache ({row['kv_target'] / 1e6:.2f}M -> "
                f"{row['kv_draft'] / 1e6:.2f}M tokens) and the gain to fall with concurrency "
                f"({gains} streams) [{row['source']}]; eval.concurrency measures yours",
            )
    if cfg.eval.draft:
        from runner.assets.transfer import packed_reason

        packed = packed_reason(Path(cfg.eval.draft).expanduser())
        if packed:
            p.error("eval.draft", packed)
        elif _draft_content(cfg.eval.draft) is None:
            p.error(
                "eval.draft",
                f"{cfg.eval.draft} holds no draft (config.json and model.safetensors)",
            )
        elif wrong := misfits(Path(cfg.eval.draft).expanduser(), view.target.layout):
            p.error(
                "eval.draft",
                f"{cfg.eval.draft} was not made for this target ({cfg.model.source}): "
                + "; ".join(wrong),
            )
        else:
            p.add("draft", f"{cfg.eval.draft} (trained elsewhere: no teacher-forced estimate)")
        if cfg.eval.random_baseline:
            p.warn(
                "eval.random_baseline",
                "not measured for eval.draft: the random draft is "
                "built from this config's own training command",
            )
    if cfg.eval.baseline_draft:
        _plan_baseline(p, cfg, view)
    if cfg.eval.choose_epoch and cfg.eval.draft:
        p.error("eval.choose_epoch", "eval.draft was trained elsewhere: there are no epochs here")
    elif cfg.eval.choose_epoch and not cfg.train.keep_epoch_drafts:
        p.error(
            "eval.choose_epoch",
            "needs every epoch's draft: set train.keep_epoch_drafts=true (it also turns the "
            "choice on)",
        )
    elif choosing_epoch(cfg):
        n = cfg.train.epochs
        p.add(
            "epoch choice",
            f"each of the {n} epochs' drafts served on the first {cfg.eval.choose_epoch_prompts} "
            f"prompts of the first set ({n} more server starts), the best evaluated fully and "
            "published (eval.choose_epoch)",
        )
    if cfg.hardware.vllm.endpoint:
        skipped = [
            k
            for k in ("compare_target", "random_baseline", "baseline_draft")
            if getattr(cfg.eval, k)
        ]
        if skipped:
            p.warn(
                ", ".join(f"eval.{k}" for k in skipped),
                "not measured: the server at hardware.vllm.endpoint serves the draft only, and "
                "the target alone or a random draft would need servers of their own",
            )
    # Every prompt file is read now (exists, parses, has the fields), not after training, and
    # its longest prompt plus the answer must fit the servers' context.
    try:
        # (The held-out set is chosen to fit when the stage runs.)
        if HELDOUT in cfg.eval.prompts and cfg.eval.draft:
            p.warn(
                "eval.prompts",
                "heldout is skipped: eval.draft was trained elsewhere, on data this run does "
                "not know",
            )
        check_prompt_room(p, cfg, view, load_prompt_sets(cfg.eval.prompts, cfg.eval.num_prompts))
        plan_room(p, cfg)
    except ConfigError as exc:
        p.error(exc.key, exc.message)
    context = cfg.model.max_context or target_context(view.target.config)
    if context and cfg.eval.max_model_len > context:
        p.error(
            "eval.max_model_len",
            f"{cfg.eval.max_model_len} exceeds the target's context of {context} tokens "
            "(vLLM would refuse it after loading; model.max_context overrides the context)",
        )


def _plan_baseline(p: Plan, cfg: RunnerConfig, view: PlanView) -> None:
    """The draft to beat must be found (or fetchable) and made for this target, now."""
    from runner.assets.transfer import packed_reason

    folder, why = baseline.locate(cfg)
    given = cfg.eval.baseline_draft
    if folder is None:
        why = why or baseline.hub_problem(str(given))  # asked now, not after training
        if why:
            p.error("eval.baseline_draft", why)
        else:
            p.add("baseline draft", f"{given}: downloaded from the hub when evaluate runs")
        return
    if packed := packed_reason(folder):
        p.error("eval.baseline_draft", packed)
    elif _draft_content(str(folder)) is None:
        p.error(
            "eval.baseline_draft", f"{folder} holds no draft (config.json and model.safetensors)"
        )
    elif wrong := misfits(folder, view.target.layout):
        p.error(
            "eval.baseline_draft",
            f"{given} was not made for this target ({cfg.model.source}): " + "; ".join(wrong),
        )
    else:
        kind = "MLA, sharing the target's kernel" if draft_is_mla(folder) else "standard attention"
        p.add(
            "baseline draft",
            f"{given} ({folder}; {kind}): served on the same prompts and settings, each set's "
            "acceptance compared prompt by prompt",
        )


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


def transient_gate(cfg: RunnerConfig) -> str:
    """eval.transient_mismatches, or its default: fail on a GPU, warn on a CPU."""
    if cfg.eval.transient_mismatches is not None:
        return str(cfg.eval.transient_mismatches)
    return "fail" if cfg.hardware.device == "cuda" else "warn"


def _gate(metrics: Mapping[str, Any], cfg: RunnerConfig) -> tuple[list[str], list[str]]:
    """What fails the run and what only warns: the floor and the identity check
    (eval.acceptance_floor, eval.gates), and transient mismatches (eval.transient_mismatches)."""
    failed = gate(metrics, cfg.eval.acceptance_floor, set_names(cfg))
    once = transient(metrics)
    if transient_gate(cfg) == "fail":
        failed, once = failed + once, []
    return (failed, once) if cfg.eval.gates == "fail" else ([], failed + once)


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
    gate=_gate,
    settings=EvalConfig,
    section="eval",
    curves=CURVES,
    curves_live=False,
    served_draft=served_draft,
    inputs=inputs,
)
