"""A sweep's jobs compared with their noise: which differ from the best by more than their
intervals, and seeds as replicates of a recipe.

    mark_noise(rows, objective)      # each row's "vs_best": best / within noise / below
    recipes(rows, swept, objective)  # one row per recipe (the swept settings but seeds):
                                     # seeds, mean, sd, 95% interval of the mean, vs_best

A job's interval is the one its stages declared beside the objective (columns `<objective>_lo`
and `<objective>_hi`, e.g. the acceptance length's bootstrap over prompts). A swept setting whose
name ends in `seed` (train.seed) makes replicates: the jobs that differ only in it are one recipe,
whose mean gets a Student-t interval (runner/core/intervals.py). Overlapping intervals mean that the
difference is inside the noise: not shown to be real at this many prompts and seeds.
"""

from __future__ import annotations

from typing import Any

from runner.core.intervals import overlap, replicates

BEST, NOISE, BELOW = "best", "within noise", "below"


def _interval(row: dict[str, Any], objective: str) -> tuple[float, float] | None:
    lo, hi = row.get(f"{objective}_lo"), row.get(f"{objective}_hi")
    return None if lo is None or hi is None else (float(lo), float(hi))


def mark_noise(rows: list[dict[str, Any]], objective: str | None) -> None:
    """Each measured row's place against the best job: "best", "within noise" (the intervals
    overlap) or "below"; rows without an interval get none."""
    measured = [r for r in rows if objective and r.get(objective) is not None]
    if not objective or not measured:
        return
    top = max(measured, key=lambda r: r[objective])
    best = _interval(top, objective)
    for r in measured:
        mine = _interval(r, objective)
        if r is top:
            r["vs_best"] = BEST
        elif best is not None and mine is not None:
            r["vs_best"] = NOISE if overlap(best, mine) else BELOW


def seed_keys(swept: list[str]) -> list[str]:
    return [k for k in swept if k.rsplit(".", 1)[-1] == "seed"]


def recipes(
    rows: list[dict[str, Any]], swept: list[str], objective: str | None
) -> list[dict[str, Any]]:
    """One row per recipe when seeds are swept (else none): its settings, how many seeds
    measured it, the objective's mean, sd and 95% interval of the mean, and its place against
    the best recipe by mean."""
    seeds = seed_keys(swept)
    if not seeds or not objective:
        return []
    settings = [k for k in swept if k not in seeds]
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        if r.get(objective) is None:
            continue
        groups.setdefault(tuple(r.get(k) for k in settings), []).append(float(r[objective]))
    out = []
    for values, measured in groups.items():
        rep = replicates(measured)
        out.append(
            {
                **dict(zip(settings, values, strict=True)),
                "seeds": rep.n,
                f"{objective}_mean": rep.mean,
                f"{objective}_sd": rep.sd,
                f"{objective}_lo": rep.lo,
                f"{objective}_hi": rep.hi,
            }
        )
    mean = f"{objective}_mean"
    if out:
        top = max(out, key=lambda r: r[mean])
        for r in out:
            both = (top[f"{objective}_lo"], top[f"{objective}_hi"])
            mine = (r[f"{objective}_lo"], r[f"{objective}_hi"])
            if r is top:
                r["vs_best"] = BEST
            elif r["seeds"] > 1 and top["seeds"] > 1:
                r["vs_best"] = NOISE if overlap(both, mine) else BELOW
    return out
