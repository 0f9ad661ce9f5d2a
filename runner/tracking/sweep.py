"""Sweeps in MLflow: one parent run per Hydra multirun, one child run per job, and the comparison.

`SweepCallback` is registered in conf/config.yaml under `hydra.callbacks`. At the start of a
multirun it creates the parent run and exports its id (EAGLE3_PARENT_RUN_ID), which every job's
run takes as `mlflow.parentRunId`. Jobs never raise out of Hydra (the entry point records a
failed job as a FAILED child and carries on), so `on_multirun_end` always runs: it builds the
comparison from the children in MLflow, logs it to the parent (`comparison.csv`, `.md`,
`.json`, `comparison.png`: the objective, or another declared column, against the swept
setting) and closes the parent, FAILED if any child failed; then the command exits 1.
The children's statuses in MLflow are the one record of which jobs failed.

Columns come from the stages (`Stage.columns`, `plotted`, `objective`, `series`), recorded by each
job as tags of its run (runner/tracking/job_tags.py), so a stage's new metric, or a k=5
evaluation's five
acceptance positions, appear without changes here; this module never imports a stage.
`comparison_rows(client, parent_id)` / `render_table(rows)` are shared with
`python -m runner.commands.report`.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import os
import shlex
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from runner.core.errors import ConfigError
from runner.core.interrupts import between_jobs, command_as_typed, held_back
from runner.core.store import writable_root
from runner.serving import shared_servers
from runner.tracking.job_tags import (
    COLUMNS_TAG,
    FLOORS_TAG,
    OBJECTIVE_TAG,
    PLOTTED_TAG,
    SERIES_TAG,
)
from runner.tracking.recipes import BEST, NOISE, mark_noise, recipes
from runner.tracking.runs import Tracker, check_store, process_tags, tracking_uri, ui_command

log = logging.getLogger("runner")
# The sweep's parent run id, exported for the jobs (the joblib launcher's too).
PARENT_ENV = shared_servers.PARENT_ENV
# Set while a search runs (an Optuna sweeper): each job must report its objective.
SEARCH_ENV = "EAGLE3_RUNNER_SEARCH"


def sweep_job() -> tuple[int, str] | None:
    """(number, overrides) of this job in a multirun (`-m`), None outside one: a sweep prints
    one plan and a line per job, not a plan and a summary for each."""
    if not HydraConfig.initialized():
        return None
    from hydra.types import RunMode

    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None
    return int(hc.job.num), shlex.join(hc.overrides.task)


def sweep_job_tags() -> dict[str, str]:
    """The job number and overrides of the current Hydra sweep job (empty outside one)."""
    if not HydraConfig.initialized():
        return {}
    hc = HydraConfig.get()
    return {"sweep.job": str(hc.job.num), "sweep.overrides": shlex.join(hc.overrides.task)}


def _root_or_exit(config: DictConfig) -> Path:
    """run.output_root, writable; else the config error, before Hydra makes its folders there
    (it would fail with a traceback)."""
    try:
        return writable_root(Path(config.run.output_root).expanduser().resolve())
    except ConfigError as exc:
        print(f"config error: {exc.key}: {exc.message}", file=sys.stderr)
        sys.exit(2)


def _tracking(config: DictConfig) -> tuple[str, str]:
    root = _root_or_exit(config)
    return tracking_uri(config.tracking.uri, root), str(root)


def end_interrupted_sweep(config: DictConfig, status: str = "KILLED") -> None:
    """A signal (or a search's refused trial) stopped the sweep, so on_multirun_end will not
    run: its parent run ends KILLED (FAILED) and the server its jobs shared stops, instead of
    both waiting for a later run."""
    shared_servers.stop_all()
    os.environ.pop(SEARCH_ENV, None)
    parent = os.environ.pop(PARENT_ENV, None)
    if not parent:
        return
    import mlflow

    uri, _ = _tracking(config)
    try:
        mlflow.MlflowClient(uri).set_terminated(parent, status=status)
    except Exception as exc:  # the store's own trouble; the next run marks it
        log.error("could not mark the sweep's parent run %s %s (%s)", parent, status, exc)


def _refuse(key: str, message: str) -> None:
    """A sweep that no job of can do what it asks: one line and exit 2, before any job runs and
    before the parent run exists."""
    print(f"config error: {key}: {message}", file=sys.stderr)
    sys.exit(2)


def check_sweep(config: DictConfig) -> bool:
    """What a sweep or a search must be before its first job (exit 2 otherwise); True for a
    search (an Optuna sweeper, which maximises each job's objective)."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    except Exception:  # Hydra refuses a malformed line itself, with its own message
        parsed = []
    seen: dict[str, int] = {}
    for o in parsed:
        seen[o.key_or_group] = seen.get(o.key_or_group, 0) + 1
    # A swept key given again: Hydra would sweep only the last list, or none of it.
    twice = sorted(
        {o.key_or_group for o in parsed if o.is_sweep_override() and seen[o.key_or_group] > 1}
    )
    if twice:
        _refuse(
            twice[0], "is swept and given again on the command line (Hydra would take the last)"
        )
    search = "optuna" in str(OmegaConf.select(config, "hydra.sweeper._target_") or "")
    if search and not (OmegaConf.select(config, "hydra.sweeper.params") or {}):
        _refuse(
            "hydra.sweeper.params", "the search space is empty: give at least one setting to search"
        )
    if search:
        _check_search(config)
    if search and config.run.plan_only:
        _refuse(
            "run.plan_only",
            "a search picks each trial from the objectives of the trials before it, which a plan "
            "does not measure; plan one trial without -m, or run the search",
        )
    return search


DIRECTIONS = ("maximize", "minimize")


def _check_search(config: DictConfig) -> None:
    """The search's own settings, in one line each (Optuna and Hydra's sweeper raise them as
    tracebacks, some only after the first trial): counts at least 1, a direction Optuna knows,
    and each parameter a non-empty choice or an interval from low to high."""
    sweeper = OmegaConf.select(config, "hydra.sweeper") or {}
    for key in ("n_trials", "n_jobs"):
        value = sweeper.get(key)
        if value is not None and (not isinstance(value, int) or value < 1):
            _refuse(f"hydra.sweeper.{key}", f"is {value!r}: a search needs a whole number >= 1")
    direction = sweeper.get("direction")
    listed = list(direction) if OmegaConf.is_list(direction) else [direction]
    wrong = [d for d in listed if d is not None and str(d).lower() not in DIRECTIONS]
    if wrong:
        _refuse(
            "hydra.sweeper.direction",
            f"is {wrong[0]!r}: Optuna takes {' or '.join(DIRECTIONS)} (the runner's objective, "
            "acceptance length, is maximized)",
        )
    parser = OverridesParser.create()
    for name, spec in (sweeper.get("params") or {}).items():
        key = f"hydra.sweeper.params.{name}"
        try:
            value = parser.parse_overrides([f"{name}={spec}"])[0].value()
        except Exception as exc:  # Hydra's parser says what it could not read
            said = " ".join(str(exc).split())
            _refuse(key, f"{spec!r} is not a search range: {said[:200]}")
        start, end = getattr(value, "start", None), getattr(value, "end", None)
        end = getattr(value, "stop", end)
        if start is not None and end is not None and not start < end:
            _refuse(key, f"{spec!r} runs from {start} down to {end}: give the low end first")


def _swept_title(overrides: list[str]) -> str:
    """'train.lr=1e-3,3e-3 vocab.draft_vocab_size=4096,8192': the sweeping overrides, as Hydra's
    own parser tells them apart from the plain ones."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        swept = [o.input_line for o in parsed if o.is_sweep_override()]
    except Exception:  # Hydra refuses the line itself before a sweep starts; a title is cosmetic
        swept = overrides
    return " ".join(swept)[:200] or "defaults"


class SweepCallback(Callback):
    """The runner's Hydra callback: the sweep's parent run, and a writable output root first."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _root_or_exit(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        search = check_sweep(config)
        if config.run.plan_only:
            print("plan only: each job prints its plan; no MLflow run is written")
            return
        import mlflow  # seconds to import; a plain run never needs it here

        uri, root = _tracking(config)
        problem = check_store(
            uri, float(config.tracking.connect_timeout_s), str(config.tracking.experiment)
        )
        if problem:  # before MLflow's own client retries for minutes
            print(f"config error: tracking.uri: {uri}: {problem}", file=sys.stderr)
            sys.exit(2)
        tracker = Tracker(config.tracking, Path(root))  # creates the experiment if needed
        client = mlflow.MlflowClient(uri)
        overrides = list(config.hydra.overrides.task)
        sweep_name = config.hydra.job.config_name
        # A sweep file names the sweep (-cn capture_layers); a command-line sweep, the overrides it
        # sweeps (the ones every job shares are in the parent's tags and in each child).
        title = sweep_name if sweep_name != "config" else _swept_title(overrides)
        run = client.create_run(
            tracker.experiment_id,
            run_name=f"sweep {title}",
            tags={
                **process_tags(),
                "sweep.config": sweep_name,
                "sweep.overrides": shlex.join(overrides),
                "sweep.params": json.dumps(
                    {k: str(v) for k, v in (config.hydra.sweeper.params or {}).items()}
                ),
            },
        )
        os.environ[PARENT_ENV] = run.info.run_id
        if search:
            os.environ[SEARCH_ENV] = "1"
        log.info("sweep parent run %s (%s)", run.info.run_id, uri)

        def stop(signum: int, _frame: Any) -> None:  # a signal between two jobs
            print(
                f"\ninterrupted by {signal.Signals(signum).name} between the sweep's jobs; the "
                f"finished jobs are kept: run the same command to continue: {command_as_typed()}",
                file=sys.stderr,
            )
            with held_back():
                end_interrupted_sweep(config)
            sys.exit(128 + signum)

        between_jobs(stop)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        # A signal while the parent closes is held until it is closed, then ends the sweep with
        # its message and code: the parent is never left RUNNING half-written.
        try:
            with held_back() as came:
                self._close(config)
        finally:
            between_jobs(signal.SIG_DFL)
        if came:
            name = signal.Signals(came[0]).name
            print(
                f"\ninterrupted by {name} while the sweep closed; its parent run was closed first",
                file=sys.stderr,
            )
            sys.exit(128 + came[0])

    def _close(self, config: DictConfig) -> None:
        import mlflow  # seconds to import; only a multirun's callback needs it

        shared_servers.stop_all()  # the online server the sweep's jobs shared, if any
        os.environ.pop(SEARCH_ENV, None)
        parent = os.environ.pop(PARENT_ENV, None)
        if not parent:
            return
        uri, _ = _tracking(config)
        client = mlflow.MlflowClient(uri)
        rows = comparison_rows(client, parent)
        failed = [r["run_id"] for r in rows if r["status"] != "FINISHED"]
        tags = children_tags(client, parent)
        declared_ = declared(tags)
        log_comparison(
            client,
            parent,
            rows,
            swept_keys(client.get_run(parent).data.tags),
            declared_,
            floors=declared_floors(tags),
        )
        print(render_table(rows))
        by_recipe = recipes(rows, swept_keys(client.get_run(parent).data.tags), declared_[0])
        if by_recipe:
            print("recipes over their seeds:\n" + render_table(by_recipe))
        client.set_terminated(parent, status="FAILED" if failed else "FINISHED")
        ui = ui_command(uri, client.get_run(parent).info.experiment_id, parent)
        print(f"sweep parent run {parent} (its children are the jobs; compare them there): {ui}")
        if failed:
            print(f"{len(failed)} sweep job(s) failed: {failed}", file=sys.stderr)
            # SystemExit passes through Hydra's callback wrapper (it catches Exception only).
            raise SystemExit(1)


def comparison_rows(client: Any, parent_id: str) -> list[dict[str, Any]]:
    parent = client.get_run(parent_id)
    children = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent_id}'",
        order_by=["attributes.start_time ASC"],
        max_results=1000,
    )
    swept = swept_keys(parent.data.tags)
    rows = _same_columns([run_row(child, swept) for child in children])
    objective = next(
        (t[OBJECTIVE_TAG] for t in (dict(c.data.tags) for c in children) if t.get(OBJECTIVE_TAG)),
        None,
    )
    mark_noise(rows, objective)
    return rows


def children_tags(client: Any, parent_id: str) -> list[dict[str, str]]:
    parent = client.get_run(parent_id)
    children = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent_id}'",
        max_results=1000,
    )
    return [dict(c.data.tags) for c in children]


def run_row(child: Any, swept: list[str]) -> dict[str, Any]:
    """One run's row of the comparison: its swept settings, capture ids and the columns its
    stages declared (the job records them as the tag `comparison.columns`)."""
    p, m, t = child.data.params, child.data.metrics, child.data.tags
    row: dict[str, Any] = {
        "job": t.get("sweep.job", ""),
        "run_id": child.info.run_id,
        "status": child.info.status,
    }
    for key in swept:
        # A config group (regenerate=none,vllm) is no param itself: its option's name or backend.
        row[key] = next((p[k] for k in (key, f"{key}.name", f"{key}.backend") if k in p), "")
    row["capture_ids"] = p.get("resolved.capture_ids_vllm", "")
    row.update(json.loads(t.get(COLUMNS_TAG, "{}")))
    # Stage names are read from the job's own tags (stage.<name> = computed | cached).
    names = [k.split(".", 1)[1] for k in t if k.startswith("stage.")]
    row["computed"] = ",".join(s for s in names if t.get(f"stage.{s}") == "computed")
    row["job_s"] = sum(m.get(f"time/{s}_s", 0.0) for s in names)
    row["alone_s"] = sum(m.get(f"time/{s}_compute_cost_s", 0.0) for s in names)
    info = child.info
    if info.status != "FINISHED":
        # A stopped or failed job timed none of its stages: its wall time, and why it ended.
        if info.end_time and info.start_time:
            row["job_s"] = row["job_s"] or (info.end_time - info.start_time) / 1000
            row["alone_s"] = row["alone_s"] or row["job_s"]
        row["reason"] = (t.get("failure") or info.status.lower()).splitlines()[0][:200]
    return row


def declared(rows_tags: list[dict[str, str]]) -> tuple[str | None, list[str], list[str]]:
    """(the objective's column, the columns to plot in order, the settings that make a plot's
    series), as the jobs' stages declared them (tags `comparison.objective`, `.plotted`,
    `.series`)."""
    objective = next((t[OBJECTIVE_TAG] for t in rows_tags if t.get(OBJECTIVE_TAG)), None)
    plotted: list[str] = []
    series: list[str] = []
    for t in rows_tags:
        plotted += [x for x in json.loads(t.get(PLOTTED_TAG, "[]")) if x not in plotted]
        series += [x for x in json.loads(t.get(SERIES_TAG, "[]")) if x not in series]
    return objective, plotted, series


def declared_floors(rows_tags: list[dict[str, str]]) -> dict[str, list[Any]]:
    """{column: [value, label]}: each plotted column's line of a draft that does nothing, as the
    jobs' stages declared it (tag `comparison.floors`)."""
    out: dict[str, list[Any]] = {}
    for t in rows_tags:
        out.update(json.loads(t.get(FLOORS_TAG, "{}")))
    return out


def swept_keys(parent_tags: dict[str, str]) -> list[str]:
    """The settings a sweep varies: its sweep config's params, then its command line's."""
    swept = list(json.loads(parent_tags.get("sweep.params", "{}")))
    return swept + [
        k for k in _swept_keys(parent_tags.get("sweep.overrides", "")) if k not in swept
    ]


def _swept_keys(overrides: str) -> list[str]:
    """Keys that a command line sweeps (`train.lr=1e-3,3e-3`, `range(...)`), as Hydra parses
    them: a list value such as `run.stages=[prepare,extract]` is not a sweep."""
    try:
        parsed = OverridesParser.create().parse_overrides(shlex.split(overrides))
    except (ValueError, HydraException):
        return []
    return [o.get_key_element().lstrip("+~") for o in parsed if o.is_sweep_override()]


def _same_columns(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every row with every column any row has (jobs may differ, e.g. in k), in first-seen order;
    positions stay in order even when a later row has more of them."""
    columns: list[str] = []
    for row in rows:
        for i, key in enumerate(row):
            if key not in columns:
                # After the previous key of this row, so acc_pos_3 follows acc_pos_2.
                at = columns.index(list(row)[i - 1]) + 1 if i else 0
                columns.insert(at, key)
    return [{c: row.get(c) for c in columns} for row in rows]


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The jobs as a Markdown table (comparison.md, which MLflow and any viewer render), with the
    run ids kept so each row leads to its run."""
    if not rows:
        return "(no jobs)"
    cols = list(rows[0])

    def line(vals: list[str]) -> str:
        return "| " + " | ".join(v.replace("|", "\\|") for v in vals) + " |"

    out = [line(cols), "|" + "|".join("---" for _ in cols) + "|"]
    out += [line([_cell(r.get(c)) for c in cols]) for r in rows]
    return "\n".join(out)


# Console tables fit this many columns unless asked wide (`report --wide`).
TABLE_WIDTH = 120


def render_table(rows: list[dict[str, Any]], width: int | None = TABLE_WIDTH) -> str:
    """The jobs as aligned text columns, for the console: the columns in order while they fit
    `width` characters (None: all), and a last line naming those left out."""
    if not rows:
        return "(no jobs)"
    cols = _decision_first([c for c in rows[0] if c not in ("run_id", "reason")])
    fmt = _cell
    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    keep = len(cols)
    if width is not None:
        used, keep = 0, 0
        for w in widths:
            if keep and used + 3 + w > width:
                break
            used += w + (3 if keep else 0)
            keep += 1

    def line(vals: list[str]) -> str:
        return " | ".join(v.ljust(w) for v, w in zip(vals[:keep], widths[:keep], strict=True))

    out = [line(cols), "-+-".join("-" * w for w in widths[:keep]), *(line(r) for r in cells)]
    if keep < len(cols):
        out.append(
            f"({len(cols) - keep} more column(s): {', '.join(cols[keep:])}; "
            "eagle3-runner report --wide, --csv or --json shows them)"
        )
    out += _best_line(rows)
    # Each job that did not finish, and why (its failure, or the signal that stopped it).
    out += [f"job {r.get('job')} {r.get('status')}: {r['reason']}" for r in rows if r.get("reason")]
    if len(rows) == 1 or "job_s" not in rows[0]:
        return "\n".join(out)
    total_job = sum(r["job_s"] for r in rows)
    total_alone = sum(r["alone_s"] for r in rows)
    out.append(
        f"sweep time {total_job:.0f} s; the same jobs alone, nothing shared: {total_alone:.0f} s"
    )
    return "\n".join(out)


def _decision_first(cols: list[str]) -> list[str]:
    """The columns a decision reads first: the job, its settings, the objective with both ends
    of its interval and vs_best; then the rest (positions, other sets, times), which a narrow
    console may name instead of showing."""
    if "vs_best" not in cols:
        return cols
    later = [c for c in ("status", "capture_ids") if c in cols]  # after the decision
    rest = [c for c in cols if c != "vs_best" and c not in later]
    his = [c for c in rest if c.endswith("_hi") and c[:-3] in rest]
    at = rest.index(his[0]) + 1 if his else len(rest)
    return [*rest[:at], "vs_best", *later, *rest[at:]]


def _best_line(rows: list[dict[str, Any]]) -> list[str]:
    """'best: job 2 (eval.num_speculative_tokens=5): acceptance_length 2.310 (2.200-2.420);
    within its noise: job(s) 1': the decision in one line, from the rows' vs_best."""
    top = next((r for r in rows if r.get("vs_best") == BEST), None)
    if top is None:
        return []
    keys = list(top)
    settings = (
        keys[keys.index("status") + 1 : keys.index("capture_ids")]
        if ("status" in keys and "capture_ids" in keys)
        else []
    )
    chosen = ", ".join(f"{k}={top.get(k)}" for k in settings)
    his = [k for k in keys if k.endswith("_hi") and k[:-3] in top and f"{k[:-3]}_lo" in top]
    figure = ""
    if his:
        name = his[0][:-3]
        figure = (
            f": {name} {_cell(top.get(name))} ({_cell(top.get(f'{name}_lo'))}-"
            f"{_cell(top.get(f'{name}_hi'))})"
        )
    close = [str(r.get("job")) for r in rows if r.get("vs_best") == NOISE]
    return [
        f"best: job {top.get('job')}"
        + (f" ({chosen})" if chosen else "")
        + figure
        + (f"; within its noise: job(s) {', '.join(close)}" if close else "")
        + ("; the rest below it" if len(rows) > 1 and not close else "")
    ]


def log_comparison(
    client: Any,
    parent_id: str,
    rows: list[dict[str, Any]],
    swept: list[str] | None = None,
    declared: tuple[str | None, list[str], list[str]] = (None, [], []),
    floors: dict[str, list[Any]] | None = None,
) -> None:
    objective, plotted, series = declared
    metric = next((c for c in plotted if any(r.get(c) is not None for r in rows)), None)
    by_recipe = recipes(rows, swept or [], objective)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "comparison.json").write_text(json.dumps(rows, indent=1, default=str))
        (d / "comparison.md").write_text(markdown_table(rows) + "\n")
        if by_recipe:  # seeds swept: each recipe's mean over its seeds, with its interval
            (d / "recipes.json").write_text(json.dumps(by_recipe, indent=1, default=str))
            (d / "recipes.md").write_text(markdown_table(by_recipe) + "\n")
        if rows:
            with open(d / "comparison.csv", "w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
            if metric is not None:
                floor = (floors or {}).get(metric)
                _plot(
                    rows,
                    d / "comparison.png",
                    metric,
                    _x_axis(rows, swept or [], series),
                    tuple(floor) if floor else None,
                )
        client.log_artifacts(parent_id, str(d))
    best = [r for r in rows if objective and r.get(objective) is not None]
    top = max(best, key=lambda r: r[objective]) if best else None
    if top is not None:
        client.log_metric(parent_id, f"best_{objective}", top[objective])
        client.set_tag(parent_id, "best_run", top["run_id"])
    for key in swept or []:  # the parent's parameters: each swept setting and its values
        values = ",".join(dict.fromkeys(str(r.get(key)) for r in rows if key in r))
        with contextlib.suppress(Exception):  # already logged (same values) by an earlier end
            client.log_param(parent_id, f"swept.{key}", values[:500])
    # What the sweep was, at the top of the parent's page in the MLflow UI.
    client.set_tag(
        parent_id,
        "mlflow.note.content",
        sweep_description(rows, swept or [], objective, top, by_recipe),
    )
    client.log_metric(parent_id, "jobs", len(rows))
    client.log_metric(parent_id, "sweep_time_s", sum(r["job_s"] for r in rows))
    client.log_metric(parent_id, "alone_time_s", sum(r["alone_s"] for r in rows))


def sweep_description(
    rows: list[dict[str, Any]],
    swept: list[str],
    objective: str | None,
    top: dict[str, Any] | None,
    by_recipe: list[dict[str, Any]] | None = None,
) -> str:
    """Markdown: what was swept over which values, the best job by the objective (and which
    jobs are within its noise), each recipe over its seeds, the table."""
    done = sum(1 for r in rows if r.get("status") == "FINISHED")
    lines = [f"**Sweep of {len(rows)} jobs** ({done} finished)."]
    for key in swept:
        values = list(dict.fromkeys(str(r.get(key)) for r in rows if key in r))
        if values:
            lines.append(f"- `{key}`: {', '.join(values)}")
    if top is not None and objective:
        chosen = ", ".join(f"`{k}={top.get(k)}`" for k in swept if k in top)
        lines.append(
            f"\n**Best by {objective}: {_cell(top[objective])}** ({chosen}; run {top['run_id']})."
        )
        close = [r["job"] for r in rows if r.get("vs_best") == NOISE]
        if close:
            lines.append(
                f"Within its noise (95% intervals overlap): job(s) {', '.join(map(str, close))}."
            )
    else:
        lines.append("\nNo job measured an objective (no evaluation), so none is ranked best.")
    if by_recipe:
        lines += ["", "**Recipes over their seeds** (mean, sd, 95% interval of the mean):", ""]
        lines.append(markdown_table(by_recipe))
    return "\n".join([*lines, "", markdown_table(rows)])


def _x_axis(
    rows: list[dict[str, Any]], swept: list[str], series_keys: list[str]
) -> tuple[str, str, str | None]:
    """(x column, its label, series column): the swept setting, capture layers shown as their
    ids; a second swept setting (the draft vocab size first) makes the series."""
    keys = [k for k in swept if k in rows[0]]
    series = next((k for k in keys if k in series_keys), None)
    others = [k for k in keys if k != series]
    if not others:
        if series is not None:
            return series, series, None
        return "capture_ids", "capture ids (vLLM convention)", None
    x = others[0]
    if "capture" in x:  # a preset or layer list: the ids it resolved to say more
        return "capture_ids", f"capture ids (vLLM convention; {x})", series
    if series is None and len(others) > 1:
        series = others[1]
    return x, x, series


def _plot(
    rows: list[dict[str, Any]],
    path: Path,
    metric: str,
    axis: tuple[str, str, str | None],
    floor: tuple[float, str] | None = None,
) -> None:
    import matplotlib.pyplot as plt

    fig = comparison_figure(rows, metric, axis, floor)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def comparison_figure(
    rows: list[dict[str, Any]],
    metric: str,
    axis: tuple[str, str, str | None],
    floor: tuple[float, str] | None = None,
) -> Any:
    """`metric` against the swept value `axis` = (key, label, series key), one line per series,
    on a y axis from zero, each point with its interval (`<metric>_lo` / `_hi`, where the rows
    have them) and `floor` (value, label), the metric of a draft that does nothing, as a line
    (the stage declares it: Stage.plotted_floor)."""
    import matplotlib  # a second to import; only the end of a sweep plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_key, x_label, series_key = axis
    xs = list(dict.fromkeys(r[x_key] for r in rows))
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(str(r.get(series_key, "all")) if series_key else "all", []).append(r)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rs in groups.items():
        pts = sorted(
            (xs.index(r[x_key]), r[metric], r.get(f"{metric}_lo"), r.get(f"{metric}_hi"))
            for r in rs
            if r.get(metric) is not None
        )
        if not pts:
            continue
        label = f"{series_key} {name}" if series_key else name
        x, y = [p[0] for p in pts], [p[1] for p in pts]
        if all(p[2] is not None and p[3] is not None for p in pts):
            # The interval of each job's figure (its prompts resampled): two jobs whose bars
            # overlap are not told apart by this sweep.
            err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=4, label=label + " (95% interval)")
        else:
            ax.plot(x, y, marker="o", label=label)
    if floor is not None:
        ax.axhline(floor[0], color="grey", linestyle="--", linewidth=1, label=floor[1])
    ax.set_xticks(range(len(xs)))
    ax.set_xticklabels(xs, rotation=15, fontsize=8)
    ax.set_xlabel(x_label)
    ax.set_ylabel(metric.replace("_", " "))
    # From zero: a zoomed axis made a 0.01 difference on 10 prompts look like a cliff.
    values = [
        v
        for r in rows
        for v in (r.get(metric), r.get(f"{metric}_hi"))
        if v is not None and r.get(metric) is not None
    ]
    if values:
        ax.set_ylim(min(0.0, min(values)), max(0.0, max(values)) * 1.08 or 1.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
