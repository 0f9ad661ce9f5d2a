"""The evaluate stage's plan and cost: what the plan says and refuses before anything loads
(the speed measurement, a draft trained elsewhere, a baseline draft, the epoch choice, the
prompts' room), its GPU cost from the rates and its CPU estimate and fit under run.time_budget,
and the settings the run and the key share with it (the speed repeats, the draft's content)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from runner.assets.sources import load_prompt_sets
from runner.assets.target_facts import ModelFacts, target_context, weight_bytes
from runner.core.errors import ConfigError
from runner.core.schema import RunnerConfig
from runner.engine import costs
from runner.engine.stage import Plan, PlanView
from stages.evaluate import baseline
from stages.evaluate.draft_fit import misfits
from stages.evaluate.epochs import choosing_epoch
from stages.evaluate.heldout import HELDOUT, plan_room
from stages.evaluate.prompt_sets import check_prompt_room
from stages.evaluate.serving import (
    draft_is_mla,
    gpu_memory_gib,
    together,
)


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
    _plan_speed(p, cfg, view)
    if cfg.eval.draft:
        _plan_draft_elsewhere(p, cfg, view)
    if cfg.eval.baseline_draft:
        _plan_baseline(p, cfg, view)
    _plan_epoch_choice(p, cfg)
    if cfg.hardware.vllm.endpoint:
        _plan_endpoint(p, cfg)
    _plan_prompts(p, cfg, view)


def _plan_speed(p: Plan, cfg: RunnerConfig, view: PlanView) -> None:
    """How the speed is measured (or that it is not), and what the KV cache is expected to give."""
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


def _plan_draft_elsewhere(p: Plan, cfg: RunnerConfig, view: PlanView) -> None:
    """eval.draft: a draft folder made for this target, neither packed nor empty."""
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


def _plan_epoch_choice(p: Plan, cfg: RunnerConfig) -> None:
    """eval.choose_epoch: refused without the epochs' drafts, else its extra servers."""
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


def _plan_endpoint(p: Plan, cfg: RunnerConfig) -> None:
    """A running server serves the draft only: what is therefore not measured."""
    skipped = [
        k for k in ("compare_target", "random_baseline", "baseline_draft") if getattr(cfg.eval, k)
    ]
    if skipped:
        p.warn(
            ", ".join(f"eval.{k}" for k in skipped),
            "not measured: the server at hardware.vllm.endpoint serves the draft only, and "
            "the target alone or a random draft would need servers of their own",
        )


def _plan_prompts(p: Plan, cfg: RunnerConfig, view: PlanView) -> None:
    """Every prompt file read now and its longest prompt with the answer fitting the context."""
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
