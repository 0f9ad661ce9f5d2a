"""One runner job: typed config, checks, target facts, plan, stages in one MLflow run, summary.

`run_job(cfg, stages=REGISTRY)` is what `python -m runner` calls once per job (once per sweep
point under `-m`), with the registry the composition root (runner/composition.py) hands it. It can
be called directly with a composed config and any stages, which is how the tests drive it.
The order is fixed: convert the composed config to `RunnerConfig` and run the config checks,
read the target's facts from its config files and check the config against them, plan once (and
stop there with `run.plan_only`), then materialise the target and execute that plan inside one
MLflow run.
Environment changes (hardware.env, MLflow's variables) are undone when the job ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from runner import SOURCE_ROOT
from runner.assets.sources import resolve_model
from runner.assets.target_facts import Target, resolve_target
from runner.core.errors import ConfigError, StageError
from runner.core.interrupts import (
    Interrupted,
    as_interrupted,
    command_as_typed,
    held_back,
    stop_on_signals,
)
from runner.core.layout import RunLayout
from runner.core.schema import RunnerConfig, schema_for, typed
from runner.core.store import ArtifactStore, writable_root
from runner.engine.budget import cpu_lines, explicit_keys, fit_budget
from runner.engine.checks import check_config, check_target
from runner.engine.console import counted, library_note, quiet_libraries
from runner.engine.costs import use_stage_rates
from runner.engine.pipeline import Pipeline, StageResult
from runner.engine.preflight import build_plan
from runner.engine.stage import Plan, Stage, check_registry
from runner.integrations.versions import TRACKED, versions
from runner.processes.cluster import is_follower
from runner.tracking.job_record import (
    end_failed,
    log_comparison,
    log_config,
    log_outputs,
    register_served,
)
from runner.tracking.runs import (
    Tracker,
    description_markdown,
    process_tags,
    tracking_uri,
)
from runner.tracking.sweep import PARENT_ENV, SEARCH_ENV, sweep_job, sweep_job_tags, swept_keys

log = logging.getLogger("runner")
# Set: an unexpected error while planning shows its traceback instead of one line.
TRACEBACK_ENV = "EAGLE3_RUNNER_TRACEBACK"
REPO = SOURCE_ROOT


@dataclass
class JobResult:
    plan: Plan
    target: Target
    # Empty for a plan-only run.
    results: dict[str, StageResult] = field(default_factory=dict)
    run_id: str | None = None
    tracking_uri: str | None = None
    seconds: float = 0.0
    # The metric a stage declares as the run's objective (returned to Hydra sweepers).
    objective: float | None = None

    @property
    def stages(self) -> dict[str, str]:
        """stage name -> "computed" or "cached"."""
        return {name: r.status for name, r in self.results.items()}


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=REPO
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _job_log_handlers() -> list[logging.Handler]:
    """The log files Hydra's job logging writes (`<run dir>/runner.log`), if any."""
    return [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]


# The libraries' warnings counted before this job (runner/engine/console.py): its summary reports
# its own.
_WARNINGS_AT_START: dict[str, int] = {}


def _setup_logging() -> None:
    _WARNINGS_AT_START.clear()
    _WARNINGS_AT_START.update(counted())
    root = logging.getLogger("runner")
    if not root.handlers:
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        root.addHandler(h)
        root.setLevel(logging.INFO)
        root.propagate = False
    # The runner's lines belong in Hydra's job log too, beside the libraries' (each job of a
    # sweep has its own file: the previous job's is replaced).
    for h in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
        root.removeHandler(h)
    for h in _job_log_handlers():
        root.addHandler(h)
    quiet_libraries()


def _echo(text: str) -> None:
    """Print `text` (the plan, the summary) and write it to Hydra's job log as well."""
    print(text, flush=True)
    for h in _job_log_handlers():
        h.handle(logging.LogRecord("runner", logging.INFO, __file__, 0, text, None, None))


@contextlib.contextmanager
def _scoped_environ() -> Iterator[None]:
    """Whatever the job sets (hardware.env, MLflow's and speculators' variables), the
    environment is afterwards exactly what it was: later jobs of a sweep, and the tests, start
    from the user's own."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _cpu_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads for the stages (hardware.cpu_threads); restored afterwards."""
    if n is None:
        yield
        return
    import torch  # only a run that computes stages needs torch in this process

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_job(node: DictConfig | RunnerConfig, stages: tuple[Stage, ...]) -> JobResult:
    """One job over `stages` (the registry, in pipeline order)."""
    _setup_logging()
    with _scoped_environ(), stop_on_signals():
        return _run_job(node, check_registry(stages))


def _output_root(node: DictConfig | RunnerConfig) -> Path:
    return Path(node.run.output_root).expanduser().resolve()


@dataclass
class _Ready:
    """A job planned: its config, target, plan and pipeline; the tracker that records it, or
    the result already (a plan only, or a node that only joined the stages spanning nodes)."""

    cfg: RunnerConfig
    target: Target
    plan: Plan
    pipeline: Pipeline
    planned: list[Any]
    tracker: Tracker | None = None
    done: JobResult | None = None


def _run_job(node: DictConfig | RunnerConfig, stages: tuple[Stage, ...]) -> JobResult:
    t_start = time.time()
    use_stage_rates(stages)
    try:  # before the job has a run of its own: a failure is recorded for a sweep's parent
        ready = _planned_job(node, stages, t_start)
    except Exception as exc:
        _record_failed_sweep_job(node, exc)
        if isinstance(exc, ConfigError | StageError) or os.environ.get(TRACEBACK_ENV):
            raise
        # Before any stage runs, what fails is reading the user's config, files or servers'
        # answers: one line, never a traceback (EAGLE3_RUNNER_TRACEBACK=1 shows where).
        raise ConfigError(
            "run",
            f"the plan could not read its inputs: {type(exc).__name__}: {str(exc)[:300]} "
            f"(set {TRACEBACK_ENV}=1 for the traceback)",
        ) from exc

    if ready.done is not None:
        return ready.done
    return _tracked_job(ready, t_start)


def _planned_job(
    node: DictConfig | RunnerConfig, stages: tuple[Stage, ...], t_start: float
) -> _Ready:
    """Everything knowable before any stage runs: the config typed and checked, the target read
    (config files only), the run sized to run.time_budget, the plan printed and its errors
    raised; then the run's tracker."""
    cfg = typed(node, schema_for(stages))
    # Everything knowable from the config alone, before anything loads.
    check_config(cfg, tuple(s.name for s in stages))
    output_root = writable_root(_output_root(node))
    layout = RunLayout(output_root)
    os.environ.update({str(k): str(v) for k, v in cfg.hardware.env.items()})
    target = resolve_target(cfg, output_root)  # config files only; no weights
    check_target(cfg, target, stages)
    # A CPU run's size fits run.time_budget at this machine's measured speed.
    cfg, budget_lines = fit_budget(cfg, target, stages, layout, explicit_keys())
    store = ArtifactStore(output_root)
    # A node after the first runs no stage of its own: it joins the stages that span nodes.
    follower = is_follower(cfg)
    if not cfg.run.plan_only and not follower:
        store.remove_dead_temps()
    pipeline = Pipeline(
        cfg, target.facts, store, stages, rerun_command=rerun_command(), layout=layout
    )
    # Planned once: the pipeline executes this plan, the one printed (no side effects).
    planned = pipeline.plan()
    if os.environ.get(SEARCH_ENV) and not any(p.stage.objective for p in planned):
        reporting = [s.name for s in stages if s.objective]
        raise ConfigError(
            "run.stages",
            "a search maximises each trial's objective, and no stage of this run reports "
            f"one; include {' or '.join(reporting) or 'a stage that declares one'}",
        )
    plan = build_plan(cfg, target, planned, pipeline.missing(planned), store, layout)
    cpu_lines(plan, cfg, target, planned, layout, budget_lines)
    job = sweep_job()
    if job is None or job[0] == 0:
        _echo(plan.render())
    else:  # a sweep's later job: its overrides and its plan's problems (the plan: MLflow)
        _echo(f"==== job {job[0]}: {job[1]} ====")
        for p in plan.problems:
            _echo(f"  {p.level.upper():<8} {p.key}: {p.message}")
    log.info("preflight took %.2f s since start", time.time() - t_start)
    plan.raise_first_error()
    if cfg.run.plan_only:
        return _Ready(
            cfg, target, plan, pipeline, planned, done=JobResult(plan=plan, target=target)
        )
    if follower:
        _follow(cfg, planned, store)
        done = JobResult(plan=plan, target=target, seconds=time.time() - t_start)
        return _Ready(cfg, target, plan, pipeline, planned, done=done)
    pipeline.refuse_damaged(planned)
    resolve_model(cfg.model, output_root)  # converts a packaged GGUF once
    # The metric the run is judged by: the experiment's primary one (MLflow's compare view).
    primary = next((f"{p.name}/{p.stage.objective}" for p in planned if p.stage.objective), None)
    tracker = Tracker(cfg.tracking, output_root, primary)
    return _Ready(cfg, target, plan, pipeline, planned, tracker)


def _tracked_job(ready: _Ready, t_start: float) -> JobResult:
    """The planned stages run inside the job's MLflow run, their outputs logged as each ends;
    the gates, the summary and the served draft's registration; the run ends FINISHED, FAILED
    or KILLED."""
    cfg, target, plan, pipeline, planned, tracker = (
        ready.cfg,
        ready.target,
        ready.plan,
        ready.pipeline,
        ready.planned,
        ready.tracker,
    )
    pipeline.tracker = tracker
    pipeline.disk_needs = {
        k.split(".", 1)[1]: v for k, v in plan.numbers.items() if k.startswith("disk_need.")
    }
    pipeline.estimates = {
        k.split(".", 1)[1][:-2]: v for k, v in plan.numbers.items() if k.startswith("estimate.")
    }
    run_id = tracker.start(_run_name(cfg, tracker), _run_tags(target))
    try:
        log_config(tracker, cfg, target)
        tracker.log_text(plan.render(), PLAN_FILE)  # the plan as printed, linked from the summary
        _STARTED.append(run_id)
        with _cpu_threads(cfg.hardware.cpu_threads):
            results = {
                r.name: r
                for r in pipeline.run(planned, done=lambda r: log_outputs(tracker, cfg, r))
            }
        log_comparison(tracker, cfg, results)
        result = JobResult(
            plan=plan,
            target=target,
            results=results,
            run_id=run_id,
            tracking_uri=tracker.uri,
            seconds=time.time() - t_start,
            objective=_objective(results),
        )
        failed, warned = _gates(results, cfg)
        if warned:  # a research run's figures that would have failed it: publish asks first
            tracker.set_tags({"gate_warnings": "; ".join(warned)[:5000]})
        summary, description = _summary(result, cfg, tracker, failed, warned)
        if not (failed or warned or cfg.run.smoke_test) and cfg.tracking.register_draft:
            register_served(tracker, cfg, results, description)
        # The results head the run's page in the MLflow UI.
        tracker.set_description(description_markdown(description) + tracker.figures_markdown())
        if failed:
            _echo(summary)  # the figures that failed, before the run ends FAILED
            raise StageError("; ".join(failed))
    except BaseException as exc:
        # A signal is not a failure of the run's own making: MLflow shows it as KILLED. A second
        # signal while the run is being closed waits until it is closed.
        signal_ = as_interrupted(exc)
        stopped = signal_ is not None
        where = f" during stage '{signal_.stage}'" if signal_ and signal_.stage else ""
        with held_back():
            end_failed(
                tracker,
                "KILLED" if stopped else "FAILED",
                f"interrupted by {signal_.name}{where}"
                if signal_
                else f"{type(exc).__name__}: {exc}",
            )
        raise
    with held_back() as came:
        tracker.end("FINISHED")
    job = sweep_job()
    if job is None:
        _echo(summary)
    else:  # the whole summary is the run's description in MLflow
        _echo(_job_line(job, result, tracker))
    if came:  # the work was done and recorded; the process still stops as it was told
        raise Interrupted(came[0], "the run had finished and is recorded as FINISHED")
    return result


def _job_line(job: tuple[int, str], result: JobResult, tracker: Tracker) -> str:
    """A sweep job's one line: its overrides, its objective, what it computed, its run."""
    name = next((r.stage.objective for r in result.results.values() if r.stage.objective), None)
    got = f"{name} {result.objective:.3f}" if name and result.objective is not None else "done"
    computed = [n for n, r in result.results.items() if r.status == "computed"]
    return (
        f"[job {job[0]}] {job[1]}: {got}; computed {', '.join(computed) or 'nothing'} in "
        f"{result.seconds:.0f} s; MLflow run {tracker.run_id}"
    )


def _follow(cfg: RunnerConfig, planned: list[Any], store: ArtifactStore) -> None:
    """A node after the first: each planned stage that spans nodes (`Stage.follow`) joins the
    leader's work; a plan with none leaves this node nothing to do."""
    spanning = [p for p in planned if p.stage.follow is not None]
    if not spanning:
        log.info("this plan has no stage that spans nodes: nothing for this node to do")
    for item in spanning:
        item.stage.follow(cfg, item, store)


def rerun_command() -> str:
    """The command line that runs this job again (its Hydra overrides; in a sweep, the sweep's
    command line)."""
    if not HydraConfig.initialized():
        return "the same command (run_job with the same config)"
    from hydra.types import RunMode

    if HydraConfig.get().mode == RunMode.MULTIRUN:
        # A sweep continues as a sweep: its whole command line, whose finished jobs are reused
        # from the store (one job's overrides would run that job alone, outside the sweep).
        return command_as_typed()
    return command_as_typed(list(HydraConfig.get().overrides.task))


# Runs of this process whose stages started: a process whose run was refused before any stage
# (or that only planned) keeps no Hydra run folder (runner/__main__.py).
_STARTED: list[str | None] = []


def stages_started() -> bool:
    return bool(_STARTED)


# The run's plan, as printed before it ran, among its artifacts.
PLAN_FILE = "plan.txt"


def _run_name(cfg: RunnerConfig, tracker: Tracker) -> str:
    name = cfg.run_name()
    # A sweep's jobs are told apart by the values they sweep (chart legends show run names);
    # the overrides every job shares would only repeat.
    parent = os.environ.get(PARENT_ENV)
    overrides = sweep_job_tags().get("sweep.overrides") if parent else None
    if not overrides:
        return name
    shown = shlex.split(overrides)
    try:
        keys = set(swept_keys(tracker.mlflow.MlflowClient(tracker.uri).get_run(parent).data.tags))
    except Exception:  # the parent cannot be read: name the job by all its overrides
        keys = set()
    swept = [o for o in shown if o.split("=", 1)[0].lstrip("+~") in keys]
    # The swept values first: MLflow's runs table cuts names at about 20 characters.
    return f"{shlex.join(swept or shown)} | {name}"


def _run_tags(target: Target) -> dict[str, str]:
    tags = {
        **process_tags(),
        "git_commit": _git_commit(),
        "model_path": target.facts.path,
        **{f"version.{lib}": v for lib, v in versions(TRACKED).items()},
    }
    parent = os.environ.get(PARENT_ENV)
    if parent:  # a job of a sweep: nest under the sweep's parent run
        tags.update(mlflow_parent_tags(parent))
    return tags


def mlflow_parent_tags(parent: str) -> dict[str, str]:
    return {"mlflow.parentRunId": parent, **sweep_job_tags()}


def _gates(results: Mapping[str, Any], cfg: RunnerConfig) -> tuple[list[str], list[str]]:
    """What the stages' gates find in their figures: (failures that fail the run, failures that
    a research setting turned into warnings)."""
    failed: list[str] = []
    warned: list[str] = []
    for r in results.values():
        if r.stage.gate is None:
            continue
        fails, warns = r.stage.gate(r.metrics, cfg)
        failed.extend(fails)
        warned.extend(warns)
    return failed, warned


def _objective(results: dict[str, StageResult]) -> float | None:
    for r in results.values():
        if r.stage.objective is not None and r.stage.objective in r.metrics:
            return float(r.metrics[r.stage.objective])
    return None


def _summary(
    result: JobResult,
    cfg: RunnerConfig,
    tracker: Tracker,
    failed: list[str] | None = None,
    warned: list[str] | None = None,
) -> tuple[str, str]:
    """The end-of-run summary for the console (the stages, then what they found), and the run's
    description in MLflow (what they found first: the page shows its first lines). `failed`,
    `warned`: what the stages' gates found that fails the run, and what only warns."""
    table = [
        f"  {r.name:<9} {r.status:<8} {r.seconds:7.1f} s  {r.path}" for r in result.results.values()
    ]
    found, key = [], []
    for r in result.results.values():
        if r.stage.summary is not None:
            lines = [f"  {line}" for line in r.stage.summary(r.metrics, r.path, cfg)]
            # The stage that holds the run's objective (evaluate) heads the description.
            (key if r.stage.objective else found).extend(lines)
    # Where the logs ended up (while a stage runs they are in its work folder, removed after).
    logs = [str(r.path / "logs") for r in result.results.values() if (r.path / "logs").is_dir()]
    if logs:
        found.append(f"  logs: {', '.join(logs)}")
    note = library_note(_WARNINGS_AT_START, [h.baseFilename for h in _job_log_handlers()])
    if note:
        found.append(f"  {note}")
    head = f"==== eagle3 runner: done in {result.seconds:.1f} s ===="
    if failed or warned:
        state = "RUN FAILED" if failed else "GATES FAILED, ONLY AS WARNINGS"
        head = f"==== eagle3 runner: {state} after {result.seconds:.1f} s ===="
        gates = [f"  gate: {g}" for g in failed or []]
        key[:0] = gates + [f"  gate (warning): {g}" for g in warned or []]
    if cfg.run.smoke_test:
        key.insert(
            0,
            "  SMOKE TEST (run.smoke_test, e.g. preset=quick): every stage works here; the "
            "figures are too small to judge a draft by",
        )
    trained = any(r.stage.objective for r in result.results.values()) and not cfg.run.smoke_test
    trained = trained and not failed
    next_step = (
        f"  next: eagle3-runner publish OUT --run {result.run_id} (the draft as a hub-ready "
        "folder with its card)"
        if trained
        else f"  next: eagle3-runner report {result.run_id}"
    )
    console = "\n".join(
        [
            "",
            head,
            *table,
            *found,
            *key,
            f"  MLflow run {result.run_id}: {tracker.ui_command()}",
            next_step,
        ]
    )
    description = "\n".join(
        [head, *(x[2:] for x in [*key, *found]), "", "stages:", *table, "", f"plan: {PLAN_FILE}"]
    )
    return console, description


def _record_failed_sweep_job(node: DictConfig | RunnerConfig, exc: Exception) -> None:
    """A sweep job that failed before its MLflow run started still shows as a FAILED child."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return
    import mlflow  # seconds to import; only a failed sweep job gets here

    client = mlflow.MlflowClient(tracking_uri(node.tracking.uri, _output_root(node)))
    exp = client.get_run(parent).info.experiment_id
    tags = {**mlflow_parent_tags(parent), "error": f"{type(exc).__name__}: {exc}"[:5000]}
    run = client.create_run(exp, tags=tags)
    client.set_terminated(run.info.run_id, status="FAILED")
