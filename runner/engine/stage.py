"""The stage contract: what one pipeline stage declares, and what it is handed when it runs.

Every module under stages/ exports one `Stage` object; `stages/__init__.py` lists them in
pipeline order (the registry, the one list of stages). The composition root (runner/composition.py)
hands that registry to the engine (`run_job(cfg, stages=...)`); no other module of runner/
imports stages/. The engine (job, pipeline, preflight, sweep, report) reads everything it needs
from these objects and never names a stage. Adding a stage is one module plus one registry line:

    STAGE = Stage(
        name="regenerate", upstream=("prepare",), version="1",
        libraries={"vllm": VLLM_DISTS}, identities=("tokenizer_id", "weights_id"),
        key_config=key_config, run=run, logged={"summary.json": "regenerate"},
        server=lambda cfg: ServerNeed(GENERATE, ...),
    )

`run(ctx)` writes its files into `ctx.out` (a temporary folder the store publishes atomically
when `run` returns) and returns metrics; `key_config(cfg, facts)` is the config slice its
output depends on. The store key hashes that slice with `version`, the upstream keys and the
installed versions of `libraries`, so changing any of them recomputes the stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from runner.core.errors import ConfigError

if TYPE_CHECKING:  # types only: these modules import this one
    from runner.assets.target_facts import ModelFacts, Target
    from runner.core.layout import RunLayout
    from runner.core.schema import RunnerConfig
    from runner.core.store import Artifact, ArtifactStore
    from runner.tracking.runs import Tracker

# Target identities a stage's output can depend on (see ModelFacts).
IDENTITIES = ("tokenizer_id", "weights_id")


@dataclass
class Problem:
    level: str  # "error" or "warning"
    key: str
    message: str


@dataclass
class Plan:
    """The preflight plan: lines a person reads, problems (each naming its key), and numbers
    the engine uses later (e.g. "disk_need.<stage>": bytes the stage will write)."""

    lines: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)
    # What each GPU stage will cost (runner/engine/costs.py): (now, with one more box).
    costs: list[tuple[Any, Any]] = field(default_factory=list)

    def add(self, label: str, value: str) -> None:
        self.lines.append(f"  {label:<26} {value}")

    def add_cost(self, stage: str, now: Any, more: Any) -> None:
        """A stage's estimate (a runner.engine.costs.Cost), now and with hardware.num_nodes + 1: its
        line here, the total and the next box's line at the end of the plan."""
        from runner.engine.costs import fmt_hours

        self.costs.append((now, more))
        self.add(
            f"cost: {stage}",
            f"~{fmt_hours(now.wall_s)}, {now.gpu_hours:,.1f} GPU-h"
            f"{' (estimate)' if now.estimate else ''}: {now.basis}",
        )
        self.numbers[f"cost.{stage}.hours"] = now.wall_s / 3600
        self.numbers[f"cost.{stage}.gpu_hours"] = now.gpu_hours
        self.numbers[f"cost.plus_one_box.{stage}.hours"] = more.wall_s / 3600

    def error(self, key: str, message: str) -> None:
        self.problems.append(Problem("error", key, message))

    def warn(self, key: str, message: str) -> None:
        self.problems.append(Problem("warning", key, message))

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.level == "error"]

    def render(self) -> str:
        out = ["==== eagle3 runner: plan ====", *self.lines]
        for p in self.problems:
            out.append(f"  {p.level.upper():<8} {p.key}: {p.message}")
        if not self.problems:
            out.append("  no problems found")
        return "\n".join(out)

    def raise_first_error(self) -> None:
        if self.errors:
            raise ConfigError(self.errors[0].key, self.errors[0].message)


# What a stage asks of a vLLM server while it runs (Stage.server).
# extraction: the target with extract_hidden_states and the hidden-states connector;
# draft: the target serving an EAGLE-3 draft (aux hidden states); generate: the target alone,
# always a server of the stage's own (hardware.vllm.endpoint serves the other kinds).
ServerKind = Literal["extraction", "draft", "generate"]
EXTRACTION: ServerKind = "extraction"
DRAFT: ServerKind = "draft"
GENERATE: ServerKind = "generate"


@dataclass(frozen=True)
class ServerNeed:
    kind: ServerKind
    # The context length the server must take, and the runner key that sets it (named when an
    # existing server's is too short).
    context: int
    context_key: str
    # Speculative tokens an existing draft server must propose (draft only), and their key.
    k: int | None = None
    k_key: str | None = None
    # The setting that makes the stage start this server: named when the installed vLLM lacks
    # what the server needs (e.g. extract.backend for an extraction server).
    key: str = "run.stages"

    @property
    def needs_eagle3(self) -> bool:
        """The target's vLLM class must capture EAGLE-3 aux hidden states."""
        return self.kind in (EXTRACTION, DRAFT)


@dataclass
class StageContext:
    """What a stage gets: the typed config, the target's facts, its inputs and folders to fill."""

    cfg: RunnerConfig
    facts: ModelFacts
    inputs: dict[str, Artifact]
    # The artifact being written (published when `run` returns).
    out: Path
    # Recorded in manifest.json; a stage may add entries (e.g. the command it ran).
    manifest: dict[str, Any]
    # A working folder outside the artifact: fresh for each run, or kept from a failed run when
    # the stage is `resumable`; removed once the stage succeeds.
    scratch: Path
    tracker: Tracker | None = None
    # The command that runs this job again (a stage that stops early tells the user to use it).
    rerun_command: str = "the same command"
    # The run's folders (store, cache, models, MLflow, Hydra's outputs).
    layout: RunLayout | None = None


@dataclass
class PlanView:
    """What a stage sees when it adds its lines to the preflight plan (nothing has loaded)."""

    cfg: RunnerConfig
    target: Target
    store: ArtifactStore
    output_root: Path
    layout: RunLayout
    # stage name -> "run", "cached" or "missing", for the stages this invocation needs.
    actions: dict[str, str]
    # stage name -> key, same stages.
    keys: dict[str, str]

    def cached_metrics(self, stage: str) -> dict[str, Any] | None:
        """Metrics of a stage's artifact that this run will reuse (None if it will not)."""
        if self.actions.get(stage) != "cached":
            return None
        art = self.store.get(stage, self.keys[stage])
        return art.manifest.get("metrics", {}) if art else None


@dataclass(frozen=True)
class Stage:
    """One stage's declaration, by concern: what keys it, what runs, what the plan asks of it,
    what the run reports."""

    name: str
    # --- key: what its output depends on -----------------------------------------------------
    # (cfg, facts) -> the config slice the output depends on (part of the key).
    key_config: Callable[[RunnerConfig, ModelFacts], dict[str, Any]]
    # (ctx) -> metrics; writes the artifact's files into ctx.out.
    run: Callable[[StageContext], dict[str, Any]]
    # Stages whose artifacts this one reads (ctx.inputs), all earlier in the registry.
    upstream: tuple[str, ...] = ()
    # Bumped when the output's format or meaning changes.
    version: str = "1"
    # label -> distribution names; their installed versions are part of the key.
    libraries: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Target identities (IDENTITIES) the output is made for; a reused artifact must match them.
    identities: tuple[str, ...] = ()
    # (cfg) -> the stages of `upstream` this config reads (default: all of them); e.g. evaluate
    # of a draft trained elsewhere (eval.draft) reads no train artifact.
    reads: Callable[[RunnerConfig], tuple[str, ...]] | None = None
    # (cfg) -> whether the pipeline has this stage at all (an optional stage, e.g. regenerate);
    # a stage that reads it finds it in ctx.inputs only when it is on.
    enabled: Callable[[RunnerConfig], bool] | None = None
    # Settings of its own: a dataclass (defaults, a `check()` raising ConfigError) that becomes
    # the config section named after the stage, or `section` (runner.core.schema.schema_for),
    # read as `cfg.<section>`; a conf/<section>/ group of options is optional. It may define
    # `resolve(cfg)` (defaults that depend on other sections) and `check_across(cfg)` (its rules
    # against other sections), called by runner/core/schema.py. Every built-in stage owns one:
    # prepare's is `data` (which regenerate and the held-out prompts read too), evaluate's
    # `eval`; the run-wide sections (model, hardware, tracking, run) are runner/core's.
    settings: type | None = None
    # The name of that section where it is not the stage's own (evaluate's `eval`, prepare's
    # `data`).
    section: str | None = None
    # --- run ----------------------------------------------------------------------------------
    # Keep the scratch folder of a failed run, so the next run resumes from it.
    resumable: bool = False
    # (metrics, cfg) -> (what fails the run, what only warns): checked once the stage's figures
    # are logged and the summary shown. A failure makes the run FAILED (exit 1) with the reasons
    # as its `failure` tag; a warning (a research setting, or a fault the run did not make)
    # leaves it FINISHED, the summary's first line and the `gate_warnings` tag saying what.
    gate: Callable[[Mapping[str, Any], RunnerConfig], tuple[list[str], list[str]]] | None = None
    # (cfg, planned item, store) -> what a node after the first does for this stage when the
    # job spans nodes (hardware.num_nodes > 1): join the leader's work and return when it ends.
    # None: the stage runs on the first node alone.
    follow: Callable[[RunnerConfig, Any, Any], None] | None = None
    # (cfg) -> the vLLM server this stage needs when it runs (None: it starts none). The plan
    # checks the installed vLLM, or hardware.vllm.endpoint, against it.
    server: Callable[[RunnerConfig], ServerNeed | None] | None = None
    # --- plan: checked and shown before anything loads -----------------------------------------
    # (cfg, target) -> raises ConfigError naming the key when this stage's settings cannot work
    # with this target (from its config files alone, seconds).
    check_target: Callable[[RunnerConfig, Target], None] | None = None
    # (plan, view) -> adds this stage's lines and problems to the preflight plan; bytes it will
    # write go to plan.numbers["disk_need.<name>"].
    plan: Callable[[Plan, PlanView], None] | None = None
    # (cfg, workload) -> seconds this stage takes on this CPU (runner/engine/cpu_speed.py: the
    # machine's measured speed, the rows, their tokens and epochs); the plan's estimate of a CPU
    # run and run.time_budget's sizing add them up. None: no CPU estimate.
    cpu_seconds: Callable[[RunnerConfig, Any], float] | None = None
    # (cfg, seconds, estimate) -> (cfg with this stage's own work lowered until estimate(cfg)
    # is at most `seconds`, the plan's line saying what changed or None): run.time_budget gives
    # a stage whose cost the rows do not set (the evaluation's prompts) a share of the budget.
    # This stage's measured rates (a YAML file beside it: `cpu`, its row for CPU estimates;
    # `gpu`, its rows by GPU kind and target), merged into runner/engine/rates.yaml's table.
    rates: Path | None = None
    cpu_fit: (
        Callable[
            [RunnerConfig, float, Callable[[RunnerConfig], float]], tuple[RunnerConfig, str | None]
        ]
        | None
    ) = None
    # --- report: MLflow, the summary, the sweep comparison --------------------------------------
    # Files or folders of the artifact (relative path -> MLflow folder) copied to the run.
    logged: Mapping[str, str] = field(default_factory=dict)
    # (metrics, artifact path, cfg) -> lines of the end-of-run summary.
    summary: Callable[[dict[str, Any], Path, RunnerConfig], list[str]] | None = None
    # (metrics) -> sweep-comparison columns, derived from the run's MLflow metrics under
    # "<name>/" (prefix removed) and under each of `also_reads` ("val/loss" -> "val_loss").
    columns: Callable[[Mapping[str, float]], dict[str, float | None]] | None = None
    also_reads: tuple[str, ...] = ()
    # The column of `columns` that ranks and plots a sweep's jobs (higher is better when it is
    # the objective's; the first stage in reverse pipeline order that has one is used).
    plotted: str | None = None
    # (value, label): the plotted column's value of a draft that does nothing (evaluate: 1.0,
    # nothing accepted), a line on the sweep's figure.
    plotted_floor: tuple[float, str] | None = None
    # Settings that make a sweep plot's series rather than its x axis (e.g. the vocab size).
    series: tuple[str, ...] = ()
    # A metric of this stage that `python -m runner` returns to Hydra sweepers to optimise.
    objective: str | None = None
    # (metrics, cfg) -> the results a published card shows, one row per measurement (e.g. per
    # prompt set: {"set", "prompts", "k", "acceptance_length", "per_position", ...}); logged with
    # the run as results.json so that tools outside the run read them without metric names.
    results: Callable[[Mapping[str, Any], RunnerConfig], list[dict[str, Any]]] | None = None
    # Curves a library logs into the run while the stage computes (a JSONL of step records in the
    # artifact, e.g. speculators' train/loss and val/loss_epoch): a run that reuses the artifact
    # replays them, so every run shows the same series. Metrics of the stage starting with
    # `curve_copies` repeat those curves' last values and are not logged again.
    curves: str | None = None
    curve_copies: tuple[str, ...] = ()
    # False: the stage writes the curves' file itself and nothing logs them while it computes,
    # so a computed run logs them from the file as a reused one does.
    curves_live: bool = True
    # Params a library logs into the run while the stage computes, kept as a JSON object in the
    # artifact: a run that reuses the artifact logs them too, so both hold the same params.
    replayed_params: str | None = None
    # artifact path -> the draft folder the stage served (None if none): a run that passes its
    # gates registers it in MLflow's model registry (tracking.register_draft).
    served_draft: Callable[[Path], Path | None] | None = None
    # (metrics, cfg, artifact path) -> the datasets the stage read, logged as MLflow run inputs:
    # [{"name", "source", "digest", "context", "rows"}] (runner/tracking/runs.py log_inputs).
    inputs: Callable[[Mapping[str, Any], RunnerConfig, Path], list[dict[str, Any]]] | None = None
    # (metrics, artifact path) -> {artifact file: rows (list of dicts)}, logged with
    # mlflow.log_table so that the UI shows them as tables.
    tables: Callable[[Mapping[str, Any], Path], dict[str, list[dict[str, Any]]]] | None = None
    # (metrics, artifact path) -> {artifact file: matplotlib figure}, logged with mlflow.log_figure.
    figures: Callable[[Mapping[str, Any], Path], dict[str, Any]] | None = None

    def is_on(self, cfg: RunnerConfig) -> bool:
        return self.enabled is None or self.enabled(cfg)

    def __post_init__(self) -> None:
        bad = [i for i in self.identities if i not in IDENTITIES]
        if bad:
            raise ValueError(f"stage {self.name}: unknown identities {bad}; use {IDENTITIES}")


def check_registry(stages: Iterable[Stage]) -> tuple[Stage, ...]:
    """The stages in pipeline order, checked: unique names, each after the stages it reads."""
    seen: set[str] = set()
    out = tuple(stages)
    for stage in out:
        missing = [u for u in stage.upstream if u not in seen]
        if missing:
            raise ValueError(f"stage {stage.name} reads {missing}, which must come before it")
        if stage.name in seen:
            raise ValueError(f"stage {stage.name} is registered twice")
        seen.add(stage.name)
    return out
