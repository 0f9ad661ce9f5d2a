"""What a job records in MLflow beside its stages' own logging: the config and the target's
resolved facts, each stage's declared outputs (files, datasets, tables, figures), the sweep
comparison's tags, the served draft in the registry, and the end of a failed or stopped run.
The engine (runner/engine/job.py) calls these with its stage results; they read the stages'
declarations (runner/engine/stage.py's `Stage`) by attribute, importing nothing of the engine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf

from runner.core.schema import RunnerConfig
from runner.tracking.job_tags import (
    COLUMNS_TAG,
    FLOORS_TAG,
    OBJECTIVE_TAG,
    PLOTTED_TAG,
    RESULTS_FILE,
    SERIES_TAG,
)
from runner.tracking.runs import Tracker, registered_name

log = logging.getLogger("runner")


def log_config(tracker: Tracker, cfg: RunnerConfig, target: Any) -> None:
    facts, layout = target.facts, target.layout
    as_dict = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    tracker.log_params(as_dict)
    tracker.log_params(
        {
            "resolved.architecture": layout.architecture,
            "resolved.layers_path": layout.layers,
            "resolved.capture_ids_vllm": list(facts.capture_ids),
            "resolved.aux_layers_vllm": list(facts.aux_layers),
            "resolved.capture_layers_output_of": [i - 1 for i in facts.capture_ids],
            "resolved.num_layers": facts.num_layers,
            "resolved.hidden_size": facts.hidden_size,
            "resolved.vocab_size": facts.vocab_size,
        }
    )
    tracker.log_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)), "config/resolved.yaml")


def log_outputs(tracker: Tracker, cfg: RunnerConfig, r: Any) -> None:
    """The files each stage declares (`Stage.logged`), copied or, if large, linked; its tables
    and figures (`Stage.tables`, `Stage.figures`) as MLflow tables and figures."""
    tracker.set_tags({f"path.{r.name}": str(r.path)})
    for rel, folder in r.stage.logged.items():
        path = r.path / rel
        if path.exists():
            tracker.log_or_link(path, folder, cfg.tracking.log_checkpoint_max_mb)
    try:
        if r.stage.inputs is not None:
            tracker.log_inputs(r.stage.inputs(r.metrics, cfg, r.path))
        for name, rows in (r.stage.tables(r.metrics, r.path) if r.stage.tables else {}).items():
            tracker.log_table(rows, name)
        for name, fig in (r.stage.figures(r.metrics, r.path) if r.stage.figures else {}).items():
            tracker.log_figure(fig, name)
    except Exception as exc:  # a figure is a view of the results: never a reason to fail
        log.warning(
            "[%s] could not log its inputs, tables or figures: %s: %s",
            r.name,
            type(exc).__name__,
            exc,
        )


def log_comparison(tracker: Tracker, cfg: RunnerConfig, results: Mapping[str, Any]) -> None:
    """Each stage's sweep columns (`Stage.columns`, from the run's MLflow metrics as logged,
    curves included), the column that ranks the jobs, and the stages' results rows."""
    metrics = tracker.metrics()
    row: dict[str, float | None] = {}
    plotted: list[str] = []
    floors: dict[str, list[Any]] = {}
    objective: str | None = None
    series: list[str] = []
    found: list[dict[str, Any]] = []
    for r in results.values():
        stage = r.stage
        if stage.columns is not None:
            prefix = f"{stage.name}/"
            mine = {k[len(prefix) :]: v for k, v in metrics.items() if k.startswith(prefix)}
            for other in stage.also_reads:
                name = other.rstrip("/") + "_"
                mine.update(
                    {name + k[len(other) :]: v for k, v in metrics.items() if k.startswith(other)}
                )
            row.update(stage.columns(mine))
        if stage.plotted and stage.objective:
            objective = stage.plotted
            plotted.insert(0, stage.plotted)  # the objective's column first: it ranks the jobs
        elif stage.plotted:
            plotted.append(stage.plotted)
        if stage.plotted and stage.plotted_floor:
            floors[stage.plotted] = list(stage.plotted_floor)
        series += [s for s in stage.series if s not in series]
        if stage.results is not None:
            found += [{"stage": r.name, **x} for x in stage.results(r.metrics, cfg)]
    tracker.set_tags(
        {
            "smoke_test": str(cfg.run.smoke_test).lower(),
            COLUMNS_TAG: json.dumps(row),
            OBJECTIVE_TAG: objective or "",
            PLOTTED_TAG: json.dumps(plotted),
            SERIES_TAG: json.dumps(series),
            FLOORS_TAG: json.dumps(floors),
        }
    )
    tracker.log_text(json.dumps(found, indent=1), RESULTS_FILE)


def register_served(
    tracker: Tracker, cfg: RunnerConfig, results: Mapping[str, Any], description: str
) -> None:
    """The served draft as a version in MLflow's model registry (never a reason to fail)."""
    name, _ = registered_name(cfg.tracking.registered_model, cfg.model.name)
    for r in results.values():
        folder = r.stage.served_draft(r.path) if r.stage.served_draft else None
        # (a reused evaluation registered its draft when it was computed)
        if folder is None or not folder.is_dir() or r.status == "cached":
            continue
        objective = r.stage.objective
        tags = {"run_id": tracker.run_id, "target": cfg.model.source}
        if objective and objective in r.metrics:
            tags[objective] = f"{r.metrics[objective]:.4f}"
        try:
            version = tracker.register_draft(name, folder, description, tags)
            log.info("registered the draft as %s version %s in MLflow's models", name, version)
        except Exception as exc:
            log.warning("could not register the draft in MLflow (%s: %s)", type(exc).__name__, exc)


def end_failed(tracker: Tracker, status: str, reason: str | None = None) -> None:
    """Close the run FAILED or KILLED without letting a tracking error hide the stage's own
    error (the caller re-raises it); a run left RUNNING is reconciled by the next run. The reason
    of a failure is the run's `failure` tag."""
    try:
        if reason:
            tracker.set_tags({"failure": reason[:5000]})
        tracker.end(status)
    except Exception as exc:
        log.error(
            "could not mark MLflow run %s %s in %s (%s: %s); the next run on this store marks it",
            tracker.run_id,
            status,
            tracker.uri,
            type(exc).__name__,
            str(exc)[:300],
        )
