"""The stage contract: what one pipeline stage declares, and what it is handed when it runs.

Every module under stages/ exports one `Stage` object; `stages/__init__.py` lists them in
pipeline order (the registry, the one list of stages). The engine (job, pipeline, preflight,
sweep, report) reads everything it needs from these objects and never names a stage. Adding a
stage is one module plus one registry line:

    STAGE = Stage(
        name="regenerate", upstream=("prepare",), version="1",
        libraries={"vllm": VLLM_DISTS}, identities=("tokenizer_id", "weights_id"),
        key_config=key_config, run=run, logged={"summary.json": "regenerate"},
    )

`run(ctx)` writes its files into `ctx.out` (a temporary folder the store publishes atomically
when `run` returns) and returns metrics; `key_config(cfg, facts)` is the config slice its
output depends on. The store key hashes that slice with `version`, the upstream keys and the
installed versions of `libraries`, so changing any of them recomputes the stage.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # types only: these modules import this one
    from runner.preflight import Plan
    from runner.schema import RunnerConfig
    from runner.store import Artifact, ArtifactStore
    from runner.target_facts import ModelFacts, Target
    from runner.tracking import Tracker

# Target identities a stage's output can depend on (see ModelFacts).
IDENTITIES = ("tokenizer_id", "weights_id")


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


@dataclass
class PlanView:
    """What a stage sees when it adds its lines to the preflight plan (nothing has loaded)."""

    cfg: RunnerConfig
    target: Target
    store: ArtifactStore
    output_root: Path
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
    name: str
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
    # Files or folders of the artifact (relative path -> MLflow folder) copied to the run.
    logged: Mapping[str, str] = field(default_factory=dict)
    # (metrics, artifact path, cfg) -> lines of the end-of-run summary.
    summary: Callable[[dict[str, Any], Path, RunnerConfig], list[str]] | None = None
    # (metrics) -> sweep-comparison columns, derived from the run's MLflow metrics under
    # "<name>/" (prefix removed) and under each of `also_reads` ("val/loss" -> "val_loss").
    columns: Callable[[Mapping[str, float]], dict[str, float | None]] | None = None
    also_reads: tuple[str, ...] = ()
    # Curves a library logs into the run while the stage computes (a JSONL of step records in the
    # artifact, e.g. speculators' train/loss and val/loss_epoch): a run that reuses the artifact
    # replays them, so every run shows the same series. Metrics of the stage starting with
    # `curve_copies` repeat those curves' last values and are not logged again.
    curves: str | None = None
    curve_copies: tuple[str, ...] = ()
    # (metrics, artifact path) -> {artifact file: rows (list of dicts)}, logged with
    # mlflow.log_table so that the UI shows them as tables.
    tables: Callable[[Mapping[str, Any], Path], dict[str, list[dict[str, Any]]]] | None = None
    # (metrics, artifact path) -> {artifact file: matplotlib figure}, logged with mlflow.log_figure.
    figures: Callable[[Mapping[str, Any], Path], dict[str, Any]] | None = None
    # (plan, view) -> adds this stage's lines and problems to the preflight plan.
    plan: Callable[[Plan, PlanView], None] | None = None
    # (cfg) -> the vLLM features this stage needs when it runs (empty: it starts no server):
    # "eagle3" (a target class that captures aux hidden states), "extract_hidden_states".
    # Preflight checks the installed vLLM for them (runner/preflight.py).
    vllm_features: Callable[[RunnerConfig], tuple[str, ...]] | None = None
    # A metric of this stage that `python -m runner` returns to Hydra sweepers to optimise.
    objective: str | None = None
    # Keep the scratch folder of a failed run, so the next run resumes from it.
    resumable: bool = False
    # (cfg) -> the stages of `upstream` this config reads (default: all of them); e.g. evaluate
    # of a draft trained elsewhere (eval.draft) reads no train artifact.
    reads: Callable[[RunnerConfig], tuple[str, ...]] | None = None
    # (cfg) -> whether the pipeline has this stage at all (an optional stage, e.g. regenerate);
    # a stage that reads it finds it in ctx.inputs only when it is on.
    enabled: Callable[[RunnerConfig], bool] | None = None

    def is_on(self, cfg: RunnerConfig) -> bool:
        return self.enabled is None or self.enabled(cfg)

    def __post_init__(self) -> None:
        bad = [i for i in self.identities if i not in IDENTITIES]
        if bad:
            raise ValueError(f"stage {self.name}: unknown identities {bad}; use {IDENTITIES}")


def registry() -> tuple[Stage, ...]:
    """The registered stages in pipeline order (stages/__init__.py), checked for consistency."""
    import stages  # here, not at the top: stage modules import this module

    seen: set[str] = set()
    for stage in stages.REGISTRY:
        missing = [u for u in stage.upstream if u not in seen]
        if missing:
            raise ValueError(f"stage {stage.name} reads {missing}, which must come before it")
        if stage.name in seen:
            raise ValueError(f"stage {stage.name} is registered twice")
        seen.add(stage.name)
    return tuple(stages.REGISTRY)


def stage_names() -> tuple[str, ...]:
    return tuple(s.name for s in registry())
