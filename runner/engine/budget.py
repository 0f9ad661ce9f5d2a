"""A CPU run's time: each stage's estimate from this machine's measured speed, and
`run.time_budget`, which sizes the data so that the whole pipeline fits.

    estimates = estimate(cfg, target, stages, layout)       # {stage: seconds}, this machine
    cfg, lines = fit_budget(cfg, target, stages, layout, explicit={"train.epochs"})

The speed is measured once per machine, format, thread count and shapes, and kept in the output
root's cache (`cache/cpu_speed.json`): a second run on the same machine sizes the same rows, so
its stages come from the store instead of being computed again for a slightly different size.

The budget shrinks `data.num_samples` only (epochs, rows' length and evaluation stay as set):
the largest number of rows, in steps of ROWS_STEP, whose estimate fits. A run whose
`data.num_samples`, `train.epochs` or `train.max_steps` is given on the command line keeps
them: the plan shows the estimate against the budget and changes nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable
from typing import Any

from runner.assets.target_facts import Target, weight_bytes
from runner.core.json_cache import remembered
from runner.core.layout import RunLayout
from runner.core.number_format import cpu_flags
from runner.core.schema import RunnerConfig
from runner.engine.cpu_speed import (
    MachineSpeed,
    TargetShape,
    Workload,
    cpu_name,
    cpu_table,
    fmt_minutes,
    probe,
)

# The budget's steps of rows, and the fewest it sizes a run down to.
ROWS_STEP = 50
MIN_ROWS = 100
# A stage whose cost the rows do not set (Stage.cpu_fit: the evaluation's prompts) may take
# this share of the budget; the rows get the rest.
FIXED_SHARE = 0.4
# Keys that, given on the command line, the budget leaves as they are.
SIZING_KEYS = ("data.num_samples", "train.epochs", "train.max_steps", "eval.num_prompts")


def shape_of(cfg: RunnerConfig, target: Target) -> TargetShape:
    w = weight_bytes(target.layout, target.config, cfg.model.weights_gib)
    return TargetShape.of(target.config, w.bytes)


def machine_speed(cfg: RunnerConfig, shape: TargetShape, layout: RunLayout | None) -> MachineSpeed:
    """This machine's speed at the run's shapes: measured, or read back from the output root's
    cache (the same machine, format, threads and shapes measured before)."""
    args = (
        str(cfg.hardware.dtype),
        cfg.hardware.cpu_threads,
        shape.hidden,
        shape.ffn,
        int(cfg.vocab.draft_vocab_size),
    )
    if layout is None:
        return probe(*args)
    ident = [cpu_name(), sorted(cpu_flags()), *args]
    key = hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]
    found = remembered(
        layout.cache / "cpu_speed.json",
        key,
        lambda: (dataclasses.asdict(probe(*args)), True),
    )
    return MachineSpeed(**found)


def _tokens(cfg: RunnerConfig, rows: int) -> int:
    """Tokens of `rows` prepared conversations: rows x data.max_seq_len x the fill measured on
    the default's data (rates.yaml cpu.row_fill)."""
    fill = float(cpu_table().get("row_fill", 0.95))
    return int(rows * cfg.data.max_seq_len * fill)


def estimate(
    cfg: RunnerConfig,
    target: Target,
    stages: Iterable[Any],
    layout: RunLayout | None,
    rows: int | None = None,
    tokens: int | None = None,
    speed: MachineSpeed | None = None,
) -> dict[str, float]:
    """Each stage's estimated seconds on this CPU (stages without an estimate left out); `rows`
    defaults to data.num_samples, `tokens` to their estimate, `speed` to this machine's."""
    shape = shape_of(cfg, target)
    speed = speed or machine_speed(cfg, shape, layout)
    rows = cfg.data.num_samples if rows is None else rows
    work = Workload(speed, rows, tokens or _tokens(cfg, rows), cfg.train.epochs, shape)
    return {
        s.name: float(s.cpu_seconds(cfg, work))
        for s in stages
        if s.is_on(cfg) and s.cpu_seconds is not None
    }


def fit_budget(
    cfg: RunnerConfig,
    target: Target,
    stages: tuple[Any, ...],
    layout: RunLayout | None,
    explicit: Iterable[str] = (),
    speed: MachineSpeed | None = None,
) -> tuple[RunnerConfig, list[str]]:
    """`cfg` with data.num_samples sized to run.time_budget on this CPU (`speed`: measured when
    not given), and the plan's lines saying what was chosen and what the budget cost. Unchanged
    off a CPU, without a budget, or when the sizing keys were given (`explicit`)."""
    budget_min = cfg.run.time_budget
    if budget_min is None or cfg.hardware.device != "cpu":
        return cfg, []
    budget = budget_min * 60.0
    asked = cfg.data.num_samples
    speed = speed or machine_speed(cfg, shape_of(cfg, target), layout)

    def total(c: RunnerConfig, rows: int | None = None) -> float:
        return sum(estimate(c, target, stages, layout, rows=rows, speed=speed).values())

    full = total(cfg)
    given = sorted(set(explicit) & set(SIZING_KEYS))
    if full <= budget:
        return cfg, []
    if given:
        return cfg, [
            f"~{fmt_minutes(full)} here, over {budget_min:g} min; kept as given "
            f"({', '.join(given)}); run.time_budget=null silences this"
        ]
    sized, lines = _fit_stages(cfg, target, stages, layout, speed, budget * FIXED_SHARE)

    def fits(step: int) -> bool:
        return total(sized, rows=max(MIN_ROWS, step * ROWS_STEP)) <= budget

    # The estimate grows with the rows: all of them, else the largest step of rows that fits.
    lo, hi = 0, max(0, (asked - 1) // ROWS_STEP)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    # Never more rows than asked: a small run over the budget keeps its rows.
    rows = asked if total(sized) <= budget else min(asked, max(MIN_ROWS, lo * ROWS_STEP))
    sized = dataclasses.replace(sized, data=dataclasses.replace(sized.data, num_samples=rows))
    took = total(sized)
    line = (
        f"{asked:,} rows would take ~{fmt_minutes(full)} here; using {rows:,} rows, "
        f"{cfg.train.epochs} epoch(s): ~{fmt_minutes(took)} (run.time_budget={budget_min:g}; "
        "set data.num_samples to choose, run.time_budget=null for the full size)"
    )
    if took > budget:
        line += f"; even {MIN_ROWS} rows take longer than the budget"
    return sized, [line, *lines]


def _fit_stages(
    cfg: RunnerConfig,
    target: Target,
    stages: tuple[Any, ...],
    layout: RunLayout | None,
    speed: MachineSpeed,
    share: float,
) -> tuple[RunnerConfig, list[str]]:
    """`cfg` with each stage that declares `cpu_fit` lowered to its share of the budget."""
    lines = []
    for stage in stages:
        if stage.cpu_fit is None or stage.cpu_seconds is None or not stage.is_on(cfg):
            continue

        def cost(c: RunnerConfig, stage: Any = stage) -> float:
            return sum(estimate(c, target, [stage], layout, speed=speed).values())

        cfg, line = stage.cpu_fit(cfg, share, cost)
        if line:
            lines.append(line)
    return cfg, lines


def explicit_keys() -> set[str]:
    """The sizing keys this run was given on the command line (Hydra's task overrides)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return set()
    keys = set()
    for o in HydraConfig.get().overrides.task:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in SIZING_KEYS:
            keys.add(key)
    return keys


def per_stage_line(estimates: dict[str, float]) -> str:
    total = sum(estimates.values())
    parts = ", ".join(f"{k} ~{fmt_minutes(v)}" for k, v in estimates.items())
    return f"{parts}; about {fmt_minutes(total)} in all"


def cpu_lines(
    plan: Any,
    cfg: RunnerConfig,
    target: Target,
    planned: list[Any],
    layout: RunLayout,
    budget_lines: list[str],
) -> None:
    """A CPU run's plan lines: this machine's measured speed, each stage's estimate here (the
    stages it will compute; a cached one costs nothing), the total, and what the budget chose.
    The estimates go to plan.numbers as "estimate.<stage>_s"."""
    if cfg.hardware.device != "cpu":
        return
    running = [p.stage for p in planned if p.action == "run"]
    shape = shape_of(cfg, target)
    plan.add("this machine", machine_speed(cfg, shape, layout).line())
    tokens = None
    for p in planned:  # a cached stage that counted the rows' tokens: the count, not a guess
        counted = _cached_metrics(layout, p) if p.action == "cached" else None
        if counted and counted.get("tokens") and counted.get("rows") == cfg.data.num_samples:
            tokens = int(counted["tokens"])
            break
    found = estimate(cfg, target, running, layout, tokens=tokens)
    for name, seconds in found.items():
        plan.numbers[f"estimate.{name}_s"] = seconds
    if found:
        within = (
            f", within run.time_budget={cfg.run.time_budget:g} min"
            if cfg.run.time_budget and not budget_lines
            else ""
        )
        plan.add("estimate here", per_stage_line(found) + within)
    elif running:
        plan.add("estimate here", "no stage this run computes has a CPU estimate")
    for line in budget_lines:
        plan.add("time budget", line)


def _cached_metrics(layout: RunLayout, planned: Any) -> dict[str, Any] | None:
    from runner.core.store import ArtifactStore

    art = ArtifactStore(layout.root).get(planned.name, planned.key)
    return art.manifest.get("metrics", {}) if art else None
