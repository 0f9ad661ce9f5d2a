"""The stage pipeline: plan keys, reuse or run each stage, publish, and log to MLflow.

`Pipeline(cfg, facts, store, tracker).run()` walks prepare -> extract -> vocab -> train -> evaluate.
Every stage's key is computable from the config alone, so the plan (what will run, what is
cached, what is missing) is known before any stage starts. A stage outside `run.stages` is never
computed: its artifact must already be in the store, or the run stops and says which stage to
run first.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from omegaconf import OmegaConf

from runner.errors import ConfigError, StageError
from runner.schema import STAGES
from runner.store import Artifact, ArtifactStore, compute_key
from runner.validate import ModelFacts

log = logging.getLogger("runner")

# Which target identity each stage's output depends on.
_PROVENANCE = {"prepare": ("tokenizer_id",), "vocab": ("tokenizer_id",), "extract": ("tokenizer_id", "weights_id"),
               "train": ("tokenizer_id", "weights_id"), "evaluate": ("tokenizer_id", "weights_id")}


def lib_version(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "absent"


def stage_module(name: str) -> ModuleType:
    return importlib.import_module(f"stages.{name}")


@dataclass
class StageContext:
    """What a stage gets: the config, the target's facts, its inputs and a folder to fill."""

    cfg: Any
    facts: ModelFacts
    inputs: dict[str, Artifact]
    out: Path
    manifest: dict[str, Any]
    tracker: Any = None
    scratch: Path | None = None

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None, prefix: str | None = None) -> None:
        if self.tracker is not None:
            self.tracker.log_metrics(metrics, prefix=prefix or f"{self.manifest['stage']}/", step=step)


@dataclass
class PlannedStage:
    name: str
    key: str
    module: ModuleType
    action: str  # "run", "cached" or "missing"
    upstream: dict[str, str] = field(default_factory=dict)


@dataclass
class StageResult:
    name: str
    key: str
    status: str  # "computed" or "cached"
    seconds: float
    path: Path
    metrics: dict[str, Any]


class Pipeline:
    def __init__(self, cfg: Any, facts: ModelFacts, store: ArtifactStore, tracker: Any = None):
        self.cfg = cfg
        self.facts = facts
        self.store = store
        self.tracker = tracker

    def _forced(self) -> set[str]:
        force = set(self.cfg.run.force)
        return set(STAGES) if "all" in force else force

    def plan(self) -> list[PlannedStage]:
        requested = list(self.cfg.run.stages)
        force = self._forced()
        last = max(STAGES.index(s) for s in requested)
        keys: dict[str, str] = {}
        planned = []
        for name in STAGES[: last + 1]:
            mod = stage_module(name)
            upstream = {u: keys[u] for u in mod.UPSTREAM}
            versions = {lib: lib_version(*alts) for lib, alts in mod.LIBRARIES.items()}
            key = compute_key(name, mod.VERSION, mod.key_config(self.cfg, self.facts), upstream, versions)
            keys[name] = key
            have = self.store.get(name, key) is not None
            if name in requested and (name in force or not have):
                action = "run"
            elif have:
                action = "cached"
            else:
                action = "missing"
            planned.append(PlannedStage(name, key, mod, action, upstream))
        # Only stages that something requested actually depends on need to exist.
        needed = set(requested)
        for p in reversed(planned):
            if p.name in needed:
                needed.update(p.upstream)
        planned = [p for p in planned if p.name in needed]
        for p in planned:
            if p.action == "missing":
                raise StageError(
                    f"stage '{p.name}' (key {p.key}) is needed but not in the store and not in run.stages. "
                    f"Run it first, e.g. `python -m runner run.stages=[{p.name}]` with the same overrides, "
                    f"or add it to run.stages."
                )
        return planned

    def run(self) -> list[StageResult]:
        results = []
        artifacts: dict[str, Artifact] = {}
        for p in self.plan():
            t0 = time.time()
            if p.action == "cached":
                art = self.store.get(p.name, p.key)
                assert art is not None
                self._check_provenance(art)
                log.info("[%s] cached: reusing %s", p.name, art.path)
                status = "cached"
            else:
                with self.store.lock(p.name, p.key):
                    art = self.store.get(p.name, p.key)
                    if art is not None and p.name not in self._forced():
                        self._check_provenance(art)
                        log.info("[%s] cached: another job finished %s meanwhile", p.name, art.path)
                        status = "cached"
                    else:
                        log.info("[%s] running (key %s)", p.name, p.key)
                        art = self._compute(p, artifacts)
                        status = "computed"
            artifacts[p.name] = art
            manifest = art.manifest
            metrics = manifest.get("metrics", {})
            seconds = time.time() - t0
            if self.tracker is not None:
                # Cached stages log their recorded metrics too, so every run holds all of them.
                self.tracker.log_metrics(metrics, prefix=f"{p.name}/")
                # Honest cost: wall time this job spent, and what computing the artifact cost once.
                self.tracker.log_metrics({f"time/{p.name}_s": seconds,
                                          f"time/{p.name}_compute_cost_s": manifest.get("seconds", 0.0),
                                          f"time/{p.name}_computed": float(status == "computed")})
                self.tracker.set_tags({f"artifact.{p.name}": p.key, f"stage.{p.name}": status})
                self.tracker.log_artifact(art.path / "manifest.json", artifact_path=f"manifests/{p.name}")
            results.append(StageResult(p.name, p.key, status, seconds, art.path, metrics))
            log.info("[%s] %s in %.1f s -> %s", p.name, status, seconds, art.path)
        return results

    def _check_provenance(self, art: Artifact) -> None:
        """A reused artifact must have been made for this target: its manifest says which.
        (Keys already include these ids; this catches stores copied or edited by hand.)"""
        made_for = art.manifest.get("model", {})
        for field_name in ("tokenizer_id", "weights_id"):
            mine = getattr(self.facts, field_name)
            theirs = made_for.get(field_name)
            if theirs is not None and theirs != mine and field_name in _PROVENANCE[art.stage]:
                raise StageError(
                    f"{art.stage} artifact {art.path} was made for another {field_name.split('_')[0]} "
                    f"({theirs}, this target has {mine}); refusing to reuse it. Delete it or run with run.force=[{art.stage}]."
                )

    def _compute(self, p: PlannedStage, artifacts: dict[str, Artifact]) -> Artifact:
        mod = p.module
        manifest: dict[str, Any] = {
            "config": mod.key_config(self.cfg, self.facts),
            "inputs": {u: {"key": artifacts[u].key, "path": str(artifacts[u].path)} for u in mod.UPSTREAM},
            "versions": {lib: lib_version(*alts) for lib, alts in mod.LIBRARIES.items()},
            "stage_version": mod.VERSION,
            "model": self.facts.as_dict(),
            "metrics": {},
        }
        scratch = self.store.root.parent / "scratch" / f"{p.name}-{p.key}"
        with self.store.writing(p.name, p.key, manifest) as tmp:
            ctx = StageContext(
                cfg=self.cfg, facts=self.facts, inputs={u: artifacts[u] for u in mod.UPSTREAM},
                out=tmp, manifest=manifest, tracker=self.tracker, scratch=scratch,
            )
            try:
                metrics = mod.run(ctx) or {}
            except (ConfigError, StageError):
                raise
            except Exception as exc:
                raise StageError(f"stage '{p.name}' failed: {type(exc).__name__}: {exc}") from exc
            manifest["metrics"] = {**manifest["metrics"], **metrics}
        art = self.store.get(p.name, p.key)
        assert art is not None
        return art


def resolved_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def config_dict(cfg: Any) -> dict[str, Any]:
    return json.loads(json.dumps(OmegaConf.to_container(cfg, resolve=True), default=str))
