"""Search beyond sweeps: `python -m runner -m -cn search` (sweeps/search.yaml), Hydra's Optuna
sweeper maximizing the evaluate stage's objective, on the reduced embedded default. Each trial is
an MLflow child with its objective and interval; Optuna's best is the best child's. CI runs this
lane (e2e)."""

from __future__ import annotations

import os
import subprocess
import sys

import mlflow
import pytest
import yaml

from runner.tracking.sweep import PARENT_ENV
from tests.conftest import REPO
from tests.test_e2e_default import REDUCED

pytestmark = pytest.mark.e2e


def test_an_optuna_search_maximizes_acceptance_with_intervals(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "runner",
        "-m",
        "-cn",
        "search",
        *REDUCED,
        f"run.output_root={tmp_path}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "hydra.sweeper.n_trials=2",
        # What is tested is the search (each trial a child with its objective, Optuna told it,
        # shared stages), not the drafts: 8 steps a trial, where the epoch took 28 s a trial here.
        "train.max_steps=8",
        "data.num_samples=16",  # one extraction for both trials: 16 rows of 256 tokens
        "eval.prompts=[mtbench]",
        "eval.num_prompts=4",
        "eval.compare_target=false",
        "eval.gates=warn",  # 8-step drafts serve near 1.0: the search, not the drafts, is tested
        "eval.random_baseline=false",
    ]
    env = {k: v for k, v in os.environ.items() if k not in (PARENT_ENV, "MLFLOW_TRACKING_URI")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("eagle3")
    runs = client.search_runs([exp.experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 2 and all(c.info.status == "FINISHED" for c in children)
    values = []
    for c in children:
        m = c.data.metrics
        al = m["evaluate/acceptance_length"]
        assert (
            m["evaluate/acceptance_length_ci_low"] <= al <= m["evaluate/acceptance_length_ci_high"]
        )
        values.append(al)
        # The trial's recipe, as Optuna chose it, is in the child's params.
        assert {"train.lr", "train.epochs", "model.capture_preset"} <= set(c.data.params)
    # Optuna was told each trial's objective: its best is the best child's.
    best = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(max(values))
    assert parent.data.metrics["best_acceptance_length"] == pytest.approx(max(values))
    # Trials share what does not depend on their recipe: one prepare and one extraction.
    for stage in ("prepare", "extract"):
        kept = [p for p in (tmp_path / "store" / stage).iterdir() if not p.name.startswith(".")]
        assert len(kept) == 1, stage
