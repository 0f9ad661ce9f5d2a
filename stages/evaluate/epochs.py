"""Choosing the epoch to ship by serving (eval.choose_epoch): each kept epoch's draft served on
the first prompts of the first set, the best one evaluated fully and published; its record
(epochs.json, the choice in the manifest) and its curve (the epoch as step)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from runner.core.errors import StageError
from runner.core.schema import RunnerConfig
from runner.core.store import damage
from runner.engine.stage import StageContext
from stages.evaluate.measures import (
    acceptance,
    prompt_interval,
)
from stages.evaluate.serving import (
    serve_sets,
)

log = logging.getLogger("runner")
# Series as step records (Stage.curves): the speed figures by concurrency level (the level as
# step) and each kept epoch's acceptance (the epoch as step).
CURVES = "curves.jsonl"


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
