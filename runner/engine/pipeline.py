"""The stage pipeline: plan keys, reuse or run each stage, publish, and log to MLflow.

    pipeline = Pipeline(cfg, facts, store, stages)    # stages: the registry, in order
    planned = pipeline.plan()                          # a value: no side effects
    results = pipeline.run(planned)                    # executes exactly that plan

Every stage's key is computable from the config alone, so the plan (what will run, what is
cached, what is missing, which stored artifact is damaged) is known before any stage starts,
and computing it changes nothing on disk. Executing it re-checks the store under each stage's
lock (another job may have finished the artifact meanwhile) and moves a damaged artifact aside
before computing it again (reported in the log). A stage outside `run.stages` is never
computed: its artifact must already be in the store, or the run stops and says which stage to
run first. The pipeline knows stages only through their `Stage` objects.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.assets.target_facts import ModelFacts
from runner.core.errors import ConfigError, StageError
from runner.core.interrupts import as_interrupted
from runner.core.layout import RunLayout
from runner.core.schema import ALL_STAGES, RunnerConfig
from runner.core.store import (
    Artifact,
    ArtifactStore,
    compute_key,
    damage,
    disk_full,
    filesystem_root,
    fmt_bytes,
    free_bytes,
    full_path,
)
from runner.engine.stage import Stage, StageContext, check_registry
from runner.integrations.versions import versions
from runner.tracking.runs import Tracker

log = logging.getLogger("runner")


@dataclass
class PlannedStage:
    stage: Stage
    key: str
    action: str  # "run", "cached" or "missing"
    upstream: dict[str, str] = field(default_factory=dict)
    # For "run": why, against the latest artifact of this stage in the store.
    why: str = ""
    # The stored artifact of this key and what is wrong with it, when it is damaged: executing
    # the plan moves it aside (run.on_damaged=recompute) before computing it again.
    damaged: tuple[Path, str] | None = None

    @property
    def name(self) -> str:
        return self.stage.name


@dataclass
class StageResult:
    stage: Stage
    key: str
    status: str  # "computed" or "cached"
    seconds: float
    path: Path
    metrics: dict[str, Any]

    @property
    def name(self) -> str:
        return self.stage.name


def _named(names: list[str], stages: tuple[Stage, ...]) -> set[str]:
    return {s.name for s in stages} if ALL_STAGES in names else set(names)


class Pipeline:
    def __init__(
        self,
        cfg: RunnerConfig,
        facts: ModelFacts,
        store: ArtifactStore,
        stages: tuple[Stage, ...],
        tracker: Tracker | None = None,
        rerun_command: str = "the same command",
        layout: RunLayout | None = None,
    ):
        self.cfg = cfg
        self.facts = facts
        self.store = store
        self.tracker = tracker
        self.rerun_command = rerun_command
        self.layout = layout or RunLayout(store.root.parent)
        self.stages = tuple(s for s in check_registry(stages) if s.is_on(cfg))
        # stage -> bytes the plan expects it to write (Plan.numbers "disk_need.<stage>")
        self.disk_needs: dict[str, float] = {}
        # stage -> seconds the plan estimated on this CPU (Plan.numbers "estimate.<stage>_s"):
        # recorded beside the measured time, so that the estimate's error can be read back.
        self.estimates: dict[str, float] = {}

    def plan(self) -> list[PlannedStage]:
        """The stages this invocation needs, each with its key and what will happen to it.
        Reads the store (and hashes what run.verify asks for); writes nothing."""
        requested = _named(self.cfg.run.stages, self.stages)
        force = _named(self.cfg.run.force, self.stages)
        on = [i for i, s in enumerate(self.stages) if s.name in requested]
        if not on:
            raise ConfigError(
                "run.stages",
                f"{sorted(requested)}: no stage of these is on in this config (an optional stage "
                "is off until its config group turns it on)",
            )
        last = max(on)
        keys: dict[str, str] = {}
        planned = []
        for stage in self.stages[: last + 1]:
            reads = stage.reads(self.cfg) if stage.reads else stage.upstream
            upstream = {u: keys[u] for u in reads if u in keys}  # (an "off" stage: none)
            config_slice = stage.key_config(self.cfg, self.facts)
            libs = versions(dict(stage.libraries))
            key = compute_key(stage.name, stage.version, config_slice, upstream, libs)
            keys[stage.name] = key
            damaged = self._damage(stage.name, key)
            have = damaged is None and self.store.get(stage.name, key) is not None
            why = ""
            if stage.name in requested and (stage.name in force or not have):
                action = "run"
                why = "forced (run.force)" if have else self._why(stage, config_slice, upstream)
                if damaged:
                    why = f"the stored artifact is damaged: {damaged[0]}: {damaged[1]}"
            elif have:
                action = "cached"
            else:
                action = "missing"
            planned.append(PlannedStage(stage, key, action, upstream, why, damaged))
        # Only stages that something requested actually depends on need to exist.
        needed = set(requested)
        for p in reversed(planned):
            if p.name in needed:
                needed.update(p.upstream)
        return [p for p in planned if p.name in needed]

    def _damage(self, stage: str, key: str) -> tuple[Path, str] | None:
        """(path, what is wrong) when the store holds this artifact damaged
        (runner.core.store.damage);
        None when it is intact or absent. A damaged artifact is never used."""
        art = self.store.get(stage, key)
        if art is None:
            return None
        wrong = damage(art, full=self.cfg.run.verify == "full")
        return None if wrong is None else (art.path, wrong)

    def refuse_damaged(self, planned: list[PlannedStage]) -> None:
        """run.on_damaged=stop: a damaged artifact the plan would use or replace stops the run
        before anything is moved or computed."""
        if self.cfg.run.on_damaged != "stop":
            return
        for p in planned:
            if p.damaged:
                path, wrong = p.damaged
                raise StageError(
                    f"the stored {p.name} artifact {path} is damaged: {wrong}. Delete it, or set "
                    "run.on_damaged=recompute to move it aside and compute it again"
                )

    def _why(self, stage: Stage, config_slice: Any, upstream: dict[str, str]) -> str:
        """What differs from the latest stored artifact of this stage: its own settings (e.g.
        data_content: the data file was edited), an upstream artifact, its code or libraries."""
        latest = self.store.latest(stage.name)
        if latest is None:
            return "nothing stored yet"
        m = latest.manifest
        mine = json.loads(json.dumps(config_slice, default=str))
        theirs = m.get("config", {})
        changed = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
        parts = []
        if "data_content" in changed:
            parts.append("data changed (its content, data_content)")
            changed.remove("data_content")
        if changed:
            parts.append("settings changed: " + ", ".join(changed))
        ups = [u for u, k in upstream.items() if m.get("inputs", {}).get(u, {}).get("key") != k]
        if ups:
            parts.append("new upstream " + ", ".join(ups))
        if m.get("stage_version") != stage.version:
            parts.append(f"stage version {m.get('stage_version')} -> {stage.version}")
        libs = versions(dict(stage.libraries))
        moved = [
            f"{n} {m.get('versions', {}).get(n)} -> {v}"
            for n, v in libs.items()
            if m.get("versions", {}).get(n) != v
        ]
        if moved:
            parts.append("libraries: " + ", ".join(moved))
        return "; ".join(parts or ["key differs"]) + f" (vs {latest.key})"

    @staticmethod
    def missing(planned: list[PlannedStage]) -> str | None:
        """Why the plan cannot run (a needed stage neither stored nor requested), or None."""
        for p in planned:
            if p.action == "missing" and p.damaged:
                return (
                    f"stage '{p.name}' (key {p.key}) is needed, but its stored artifact is "
                    f"damaged ({p.damaged[1]}; {p.damaged[0]}) and it is not in run.stages, so it "
                    f"cannot be computed again: add it to run.stages (run.stages=[{p.name}] with "
                    "the same overrides first, or the whole pipeline)"
                )
            if p.action == "missing":
                return (
                    f"stage '{p.name}' (key {p.key}) is needed but not in the store and not in "
                    f"run.stages. Run it first, e.g. `python -m runner run.stages=[{p.name}]` "
                    "with the same overrides, or add it to run.stages."
                )
        return None

    def run(
        self, planned: list[PlannedStage], done: Callable[[StageResult], None] | None = None
    ) -> list[StageResult]:
        """Execute `planned` (from `plan()`, as printed): reuse or compute each stage in order;
        `done(result)` after each one (its outputs are logged then, so that a run that fails
        later still shows what the earlier stages read and wrote)."""
        why = self.missing(planned)
        if why:
            raise ConfigError("run.stages", why)
        self.refuse_damaged(planned)
        force = _named(self.cfg.run.force, self.stages)
        results = []
        artifacts: dict[str, Artifact] = {}
        for p in planned:
            try:
                results.append(self._run_one(p, force, artifacts))
                if done is not None:
                    done(results[-1])
            except BaseException as exc:
                stopped = as_interrupted(exc)
                if stopped is None:
                    raise
                stopped.stage = stopped.stage or p.name
                if stopped is exc:
                    raise
                raise stopped from None
        return results

    def _run_one(
        self, p: PlannedStage, force: set[str], artifacts: dict[str, Artifact]
    ) -> StageResult:
        """One stage: reuse or compute it, then track it."""
        t0 = time.time()
        if p.damaged is not None:
            art = self.store.get(p.name, p.key)
            if art is not None and art.path == p.damaged[0]:
                aside = self.store.set_aside(art)
                log.warning(
                    "[%s] stored artifact damaged (%s): moved to %s; computing it again",
                    p.name,
                    p.damaged[1],
                    aside,
                )
        art = self.store.get(p.name, p.key) if p.action == "cached" else None
        if art is not None:
            self._check_provenance(p.stage, art)
            status = "cached"  # one line for it, below, once it is recorded
        else:
            with self.store.lock(p.name, p.key):
                art = self.store.get(p.name, p.key)
                if art is not None and p.name not in force:
                    self._check_provenance(p.stage, art)
                    log.info("[%s] cached: another job finished %s meanwhile", p.name, art.path)
                    status = "cached"
                else:
                    log.info("[%s] running (key %s): %s", p.name, p.key, p.why or "new")
                    art = self._compute(p, artifacts)
                    status = "computed"
        artifacts[p.name] = art
        manifest = art.manifest
        metrics = manifest.get("metrics", {})
        seconds = time.time() - t0
        if self.tracker is not None:
            try:
                self._track(p, art, status, seconds, manifest)
            except Exception as exc:  # locked, full or unreachable: say which store
                raise StageError(
                    f"the MLflow store {self.tracker.uri} failed while recording stage "
                    f"'{p.name}' ({type(exc).__name__}: {exc}); the artifact itself is published "
                    f"at {art.path}"
                ) from exc
        done = "cached, reused" if status == "cached" else status
        log.info("[%s] %s in %.1f s -> %s", p.name, done, seconds, art.path)
        return StageResult(p.stage, p.key, status, seconds, art.path, metrics)

    def _track(
        self, p: PlannedStage, art: Artifact, status: str, seconds: float, manifest: dict
    ) -> None:
        assert self.tracker is not None
        # Cached stages log their recorded metrics too, so every run holds all of them.
        stage = p.stage
        metrics = {
            k: v
            for k, v in manifest.get("metrics", {}).items()
            if not (stage.curves and k.startswith(stage.curve_copies))
        }
        self.tracker.log_metrics(metrics, prefix=f"{p.name}/")
        kept = art.path / stage.replayed_params if stage.replayed_params else None
        if status == "cached" and kept is not None and kept.is_file():
            self.tracker.log_params(json.loads(kept.read_text()))
        replay = status == "cached" or not stage.curves_live
        if stage.curves and replay and (art.path / stage.curves).is_file():
            self.tracker.replay_curves(art.path / stage.curves)
        # Honest cost: wall time this job spent, and what computing the artifact cost once.
        self.tracker.log_metrics(
            {
                f"time/{p.name}_s": seconds,
                f"time/{p.name}_compute_cost_s": manifest.get("seconds", 0.0),
                f"time/{p.name}_computed": float(status == "computed"),
            }
        )
        if status == "computed" and p.name in self.estimates:
            self.tracker.log_metrics({f"time/{p.name}_estimate_s": self.estimates[p.name]})
        self.tracker.set_tags({f"artifact.{p.name}": p.key, f"stage.{p.name}": status})
        self.tracker.log_artifact(art.path / "manifest.json", artifact_path=f"manifests/{p.name}")

    def _check_provenance(self, stage: Stage, art: Artifact) -> None:
        """A reused artifact must have been made for this target: its manifest says which.
        (Keys already include these ids; this catches stores copied or edited by hand.)"""
        made_for = art.manifest.get("model", {})
        for field_name in stage.identities:
            mine = getattr(self.facts, field_name)
            theirs = made_for.get(field_name)
            if theirs is not None and theirs != mine:
                raise StageError(
                    f"{stage.name} artifact {art.path} was made for another "
                    f"{field_name.split('_')[0]} ({theirs}, this target has {mine}); refusing to "
                    f"reuse it. Delete it or run with run.force=[{stage.name}]."
                )

    def _compute(self, p: PlannedStage, artifacts: dict[str, Artifact]) -> Artifact:
        stage = p.stage
        config_slice = stage.key_config(self.cfg, self.facts)
        manifest: dict[str, Any] = {
            "config": config_slice,
            "inputs": {
                u: {"key": artifacts[u].key, "path": str(artifacts[u].path)} for u in p.upstream
            },
            "versions": versions(dict(stage.libraries)),
            "stage_version": stage.version,
            "model": self.facts.as_dict(),
            # Where it ran: the plan's cost estimates take rates from finished runs of the same
            # hardware (runner/engine/costs.py). Not in the key: the result is the same elsewhere.
            "hardware": {
                "name": self.cfg.hardware.name,
                "gpu_kind": self.cfg.hardware.gpu_kind,
                "num_gpus": self.cfg.hardware.num_gpus,
                "num_nodes": self.cfg.hardware.num_nodes,
            },
            "metrics": {},
        }
        if p.name in self.estimates:
            manifest["estimate_s"] = self.estimates[p.name]
        scratch = self.store.scratch(p.name, p.key)
        if not stage.resumable:
            shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True, exist_ok=True)
        try:
            self._compute_into(p, manifest, scratch, artifacts)
        except BaseException:
            self._leave_scratch(stage, scratch)
            raise
        shutil.rmtree(scratch, ignore_errors=True)
        with contextlib.suppress(OSError):
            scratch.parent.rmdir()  # only if empty
        art = self.store.get(p.name, p.key)
        assert art is not None
        return art

    def _disk_full_error(self, stage: str, where: Path) -> StageError:
        """One line: where, how much is free, what the plan said the stage needs, what to do.
        Nothing is published (the temporary folder goes); the same command continues."""
        need = self.disk_needs.get(stage)
        planned = f"; the plan estimated {fmt_bytes(need)} for it" if need else ""
        return StageError(
            f"disk full: stage '{stage}' could not write {where} ({fmt_bytes(free_bytes(where))} "
            f"free on {filesystem_root(where)}{planned}). Nothing was published; free space or "
            "move run.output_root (or lower data.num_samples), then run the same command"
        )

    @staticmethod
    def _leave_scratch(stage: Stage, scratch: Path) -> None:
        """After a failure: a resumable stage's work folder is kept (and said so) when it holds
        something; anything else is removed."""
        if stage.resumable and scratch.is_dir() and any(scratch.iterdir()):
            log.warning("[%s] work folder kept for the next run to resume: %s", stage.name, scratch)
            return
        shutil.rmtree(scratch, ignore_errors=True)
        with contextlib.suppress(OSError):
            scratch.parent.rmdir()

    def _compute_into(
        self,
        p: PlannedStage,
        manifest: dict[str, Any],
        scratch: Path,
        artifacts: dict[str, Artifact],
    ) -> None:
        stage = p.stage
        with self.store.writing(p.name, p.key, manifest) as tmp:
            ctx = StageContext(
                cfg=self.cfg,
                facts=self.facts,
                inputs={u: artifacts[u] for u in p.upstream},
                out=tmp,
                manifest=manifest,
                scratch=scratch,
                tracker=self.tracker,
                rerun_command=self.rerun_command,
                layout=self.layout,
            )
            try:
                metrics = stage.run(ctx) or {}
            except (ConfigError, StageError) as exc:
                if disk_full(exc, tmp):
                    raise self._disk_full_error(p.name, full_path(exc, tmp)) from exc
                raise
            except Exception as exc:
                if disk_full(exc, tmp):  # the partial output is still there: the disk is full
                    raise self._disk_full_error(p.name, full_path(exc, tmp)) from exc
                raise StageError(f"stage '{p.name}' failed: {type(exc).__name__}: {exc}") from exc
            manifest["metrics"] = {**manifest["metrics"], **metrics}
