"""The draft to beat (`eval.baseline_draft`): where it comes from, and how the run's draft
compares with it on the same prompts, server settings and engine.

    where = locate(cfg)                 # (folder or None, why not, what it is) - the plan's
    folder = fetch(cfg)                 # the stage's: a hub id is downloaded here
    rows = compare(ours, theirs, names) # per set: both lengths, the paired difference, a verdict

`eval.baseline_draft` is a draft folder, a finished run of this output root's MLflow store
(`run:<run id>`: its trained draft), or a hub id (`org/name`, from the Hugging Face cache or
downloaded when the stage runs). Served with the same settings as the run's own draft (an MLA
draft shares the target's attention kernel), on the same prompts, so the two acceptance lengths
pair prompt by prompt: the verdict comes from the 95% interval of their difference, prompts
resampled together (runner/core/intervals.py).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from runner.core.intervals import paired_ratio_difference
from runner.core.schema import RunnerConfig
from runner.engine.stage import StageContext
from runner.tracking.runs import tracking_uri
from stages.evaluate.measures import (
    acceptance,
    by_concurrency,
    per_set,
    prompt_interval,
    speed_metrics,
)
from stages.evaluate.serving import serve_sets

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
BETTER, SAME, WORSE = "better", "within noise", "worse"


def _run_draft(cfg: RunnerConfig, run_id: str) -> tuple[Path | None, str]:
    """The trained draft of a finished run of this root's store."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri(cfg.tracking.uri, Path(cfg.run.output_root)))
    try:
        run = client.get_run(run_id)
    except Exception as exc:  # MLflow raises its own exception for an unknown id
        return None, f"run {run_id} is not in this output root's MLflow store ({exc})"[:400]
    if run.info.status != "FINISHED":
        return None, f"run {run_id} is {run.info.status}, not a finished run"
    train = run.data.tags.get("path.train")
    if not train:
        return None, f"run {run_id} trained no draft (no path.train tag)"
    return Path(train) / "draft", ""


def _cached_hub(repo: str) -> Path | None:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo, local_files_only=True))
    except Exception:  # not in the cache (huggingface_hub raises several kinds)
        return None


def is_hub_id(value: str) -> bool:
    """org/name that is not a local path."""
    return bool(HUB_ID.match(value)) and not Path(value).expanduser().exists()


def locate(cfg: RunnerConfig) -> tuple[Path | None, str]:
    """(folder, "") where the baseline lies now; (None, why) if it cannot be served; a hub id
    not yet in the cache gives (None, "") where downloading is allowed (the stage fetches)."""
    value = str(cfg.eval.baseline_draft)
    if value.startswith("run:"):
        return _run_draft(cfg, value[4:])
    folder = Path(value).expanduser()
    if folder.exists() or not HUB_ID.match(value):
        return (folder, "") if folder.is_dir() else (None, f"{value} is not a folder")
    found = _cached_hub(value)
    if found is not None:
        return found, ""
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return None, f"hub id {value} is not in the Hugging Face cache and HF_HUB_OFFLINE=1"
    return None, ""


def hub_problem(value: str, timeout_s: float = 10.0) -> str | None:
    """Why a hub draft not yet cached cannot be fetched from here (the hub does not answer
    for it within `timeout_s`: no network, an unknown or gated repo), or None."""
    from huggingface_hub import HfApi

    try:
        HfApi().model_info(value, timeout=timeout_s)
    except Exception as exc:  # unreachable hub, unknown repo, gated
        return (
            f"hub id {value} is not in the Hugging Face cache and the hub does not answer for it "
            f"({type(exc).__name__}: {str(exc)[:160]}): download it where there is a network, "
            "or give its folder"
        )
    return None


def fetch(cfg: RunnerConfig) -> Path:
    """The baseline's folder, downloading a hub id that is not cached yet."""
    folder, why = locate(cfg)
    if folder is not None:
        return folder
    if why:
        raise FileNotFoundError(why)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(cfg.eval.baseline_draft)))


def compare(
    ours: dict[str, list[dict[str, Any]]], theirs: dict[str, list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """Per prompt set: each draft's acceptance length (1 + accepted / drafts over the set's
    prompts), their difference and its 95% interval with prompts resampled in pairs, and the
    verdict: better or worse where the interval excludes 0, else within noise."""
    rows = []
    for name, mine in ours.items():
        other = theirs.get(name)
        if not other or len(other) != len(mine):
            continue
        pairs = [(a, b) for a, b in zip(mine, other, strict=True) if a["drafts"] and b["drafts"]]
        if not pairs:
            continue
        diff, lo, hi = paired_ratio_difference(
            [a["accepted"] for a, _ in pairs],
            [a["drafts"] for a, _ in pairs],
            [b["accepted"] for _, b in pairs],
            [b["drafts"] for _, b in pairs],
        )
        rows.append(
            {
                "set": name,
                "prompts": len(pairs),
                "acceptance_length": 1
                + sum(a["accepted"] for a, _ in pairs) / sum(a["drafts"] for a, _ in pairs),
                "baseline_acceptance_length": 1
                + sum(b["accepted"] for _, b in pairs) / sum(b["drafts"] for _, b in pairs),
                "difference": diff,
                "difference_ci_low": lo,
                "difference_ci_high": hi,
                "verdict": BETTER if lo > 0 else WORSE if hi < 0 else SAME,
            }
        )
    return rows


def against_baseline(
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
    theirs = fetch(cfg)
    _, base = serve_sets(cfg, ctx.facts, theirs, sets, "baseline", logs, speed_repeats=repeats)
    ctx.manifest["baseline"] = {"draft": str(theirs), "given": cfg.eval.baseline_draft}
    rows = compare(
        {n: spec[n]["per_prompt"] for n in sets}, {n: base[n]["per_prompt"] for n in sets}
    )
    for name, result in base.items():
        pre = "" if name == first else f"{name}/"
        measured = per_set(acceptance(result["counters"]))
        measured.update(prompt_interval(result["per_prompt"]))
        metrics.update({f"baseline/{pre}{k}": v for k, v in measured.items()})
    verdicts = {BETTER: 1, SAME: 0, WORSE: -1}
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
