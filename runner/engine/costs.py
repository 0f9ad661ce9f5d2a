"""What a run will cost: the pieces every stage's estimate is made of, and the plan's totals.

    p.add_cost(Cost(...), Cost(...))   # a stage's plan hook: now, and with one more box
    rows("train"), scaled(row, "RTX PRO 6000", rate), measured(view, "train")

A stage that runs on GPUs estimates its own wall time and GPU-hours in its plan hook (extract,
train, evaluate do) from, first match wins: this store's latest finished artifact of that stage
made on the same hardware (`measured`: manifests record the hardware), a planned figure the
config gives, then the stage's shipped rates (stages/<stage>/rates.yaml: rows measured on an
H200, estimates marked as such), scaled to another GPU kind by runner/engine/rates.yaml's
`gpu_speed` factor. Every line says where its
rate came from, and "estimate" wherever a figure is not a measurement of this configuration.
The preflight adds the total and what one more box would change (`total_lines`).

GPU-hours count every GPU of every box a stage holds (a box waiting on its server still holds
its GPUs). Data-parallel efficiency: the one measured at 2 GPUs, once per doubling of ranks.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.core.schema import RunnerConfig

RATES = Path(__file__).with_name("rates.yaml")
# Each stage's own rates (Stage.rates: stages/<stage>/rates.yaml), by stage name, as the
# registry gives them (use_stage_rates).
_STAGE_RATES: dict[str, Path] = {}


def use_stage_rates(stages: Any) -> None:
    """Merge the registry's stages' rates files into the table (the composition root and each
    job call it with the stages they run)."""
    found = {s.name: Path(s.rates) for s in stages if getattr(s, "rates", None) is not None}
    if found != _STAGE_RATES:
        _STAGE_RATES.clear()
        _STAGE_RATES.update(found)
        _merged.cache_clear()


@functools.cache
def _load(path: Path) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path))  # type: ignore[return-value]


def table() -> dict[str, Any]:
    """rates.yaml with each registered stage's own rates: its `cpu` row under `cpu.<stage>`, its
    `gpu` rows as the section `<stage>`, any other section of its file as it is."""
    return _merged(tuple(sorted(_STAGE_RATES.items())))


@functools.cache
def _merged(stage_files: tuple[tuple[str, Path], ...]) -> dict[str, Any]:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in _load(RATES).items()}
    out["cpu"] = dict(out.get("cpu") or {})
    for name, path in stage_files:
        own = _load(path)
        if "cpu" in own:
            out["cpu"][name] = own["cpu"]
        if "gpu" in own:
            out[name] = own["gpu"]
        out.update({k: v for k, v in own.items() if k not in ("cpu", "gpu")})
    return out


def rows(section: str) -> list[dict[str, Any]]:
    return list(table().get(section) or [])


@dataclass
class Cost:
    """One stage's estimate: `what` names it in sentences ("extraction")."""

    what: str
    wall_s: float
    gpu_hours: float
    basis: str  # how it was computed, and from what
    estimate: bool  # not a measurement of this configuration


def _speed(kind: str) -> float | None:
    row = table()["gpu_speed"].get(kind)
    return float(row["factor"]) if row else None


def scaled(
    row: dict[str, Any], kind: str | None, value: float, is_time: bool = False
) -> tuple[float, str, bool] | None:
    """A row's rate (or time, `is_time`) on GPU `kind`: (value, source, estimate?). As measured
    when the row is of that kind; else scaled by the two kinds' speed factors (an estimate);
    None without a kind, or when either kind has no factor."""
    if kind is None:
        return None
    if row["gpu"] == kind:
        return value, row["source"], not row["measured"]
    mine, theirs = _speed(kind), _speed(row["gpu"])
    if mine is None or theirs is None:
        return None
    factor = mine / theirs
    return (
        value / factor if is_time else value * factor,
        f"estimate: {row['gpu']}'s {value:,.0f} scaled {factor:.2f}x for {kind} ({row['source']})",
        True,
    )


def first_scaled(
    candidates: list[dict[str, Any]], kind: str | None, field_name: str, is_time: bool = False
) -> tuple[dict[str, Any], tuple[float, str, bool]] | None:
    """The first row (this GPU kind's own first) whose `field_name` scales to `kind`."""
    for row in sorted(candidates, key=lambda r: r["gpu"] != kind):
        got = scaled(row, kind, float(row[field_name]), is_time)
        if got:
            return row, got
    return None


def measured(view: Any, stage: str) -> Any:
    """This store's latest finished artifact of `stage` made on this hardware (name and GPU
    kind), or None: its metrics are rates of this very machine."""
    art = view.store.latest(stage)
    if art is None:
        return None
    hw = art.manifest.get("hardware") or {}
    cfg = view.cfg
    same = hw.get("name") == cfg.hardware.name and hw.get("gpu_kind") == cfg.hardware.gpu_kind
    return art if same else None


def efficiency(ranks: int, at_two: float) -> float:
    """Per-GPU efficiency of `ranks` data-parallel ranks: at_two once per doubling."""
    return at_two ** math.log2(ranks) if ranks > 1 else 1.0


def box_gpus(cfg: RunnerConfig, nodes: int) -> int:
    return cfg.hardware.num_gpus * nodes


def prepared_tokens(view: Any, upstream: str) -> tuple[int, bool]:
    """The token count of the rows `upstream` (the stage that tokenises the data) prepared, if
    the run reuses its artifact (exact), else the upper bound num_samples x max_seq_len (False)."""
    prepared = view.cached_metrics(upstream) if view.actions.get(upstream) else None
    if prepared and prepared.get("tokens"):
        return int(prepared["tokens"]), True
    return view.cfg.data.num_samples * view.cfg.data.max_seq_len, False


def fmt_hours(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:,.1f} h"
    return f"{seconds / 60:,.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def total_lines(plan: Any, cfg: RunnerConfig) -> None:
    """The total and what one more box would change, from the costs the stages added."""
    hw = cfg.hardware
    if hw.device != "cuda":
        return
    if not hw.gpu_kind:
        plan.add("cost", "no estimate: set hardware.gpu_kind (e.g. H200) for times from rates")
        return
    if not plan.costs:
        return
    now = [c for c, _ in plan.costs]
    more = [m for _, m in plan.costs]
    wall, gpu_h = sum(c.wall_s for c in now), sum(c.gpu_hours for c in now)
    plan.numbers.update({"cost.total.hours": wall / 3600, "cost.total.gpu_hours": gpu_h})
    boxes = f"{hw.num_nodes} box{'es' if hw.num_nodes > 1 else ''} of {hw.num_gpus} {hw.gpu_kind}"
    plan.add("cost: total", f"~{fmt_hours(wall)}, {gpu_h:,.1f} GPU-h on {boxes}")
    plan.numbers["cost.plus_one_box.total.hours"] = sum(m.wall_s for m in more) / 3600
    plan.add(
        "one more box",
        f"{hw.num_nodes + 1} boxes: "
        + ", ".join(f"{m.what} ~{fmt_hours(m.wall_s)}" for m in more)
        + f"; total ~{fmt_hours(sum(m.wall_s for m in more))}, "
        f"{sum(m.gpu_hours for m in more):,.1f} GPU-h",
    )
