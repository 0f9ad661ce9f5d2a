"""The speed figures of an evaluation from its timed passes (serving.py times them): the
speed-up at concurrency 1 and at batch, the independent client's agreement (speed_check.py),
the gain by concurrency with its crossover and curves, and each server's KV capacity."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runner.engine.stage import StageContext
from runner.serving.vllm_server import kv_capacity
from stages.evaluate.epochs import CURVES
from stages.evaluate.measures import by_concurrency, crossover, paired_noise, speed_metrics
from stages.evaluate.speed_check import agreement

CURVED = (
    "gain",
    "draft_tok_s",
    "target_tok_s",
    "draft_tok_s_per_stream",
    "target_tok_s_per_stream",
)


def speed_figures(
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


def kv_figures(logs: Path) -> dict[str, float]:
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
