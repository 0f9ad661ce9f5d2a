"""A 3 x 3 sweep (capture layers x draft vocab size) through `python -m runner -m`, on a tiny
12-layer model: one extraction shared by all nine jobs, one MLflow parent with nine children,
and the comparison table in the parent and from `python -m runner.commands.report`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.tracking.sweep import PARENT_ENV
from tests.conftest import REPO, tiny_overrides


def run_sweep(model_dir, chats, root, *sweep_args, samples=20, steps=2):
    """`python -m runner -m <sweep_args>` on the tiny model, in a fresh process, as a user runs
    it."""
    base = tiny_overrides(model_dir, chats, root, samples=samples, steps=steps, vocab=None)
    cmd = [sys.executable, "-m", "runner", "-m", *sweep_args, *base]
    env = {k: v for k, v in os.environ.items() if k not in (PARENT_ENV, "MLFLOW_TRACKING_URI")}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)


@pytest.fixture(scope="module")
def sweep(tiny12_model_dir, chats_jsonl, tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep_out")
    proc = run_sweep(
        tiny12_model_dir, chats_jsonl, root, "-cn", "capture_x_vocab", samples=30, steps=3
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root, proc.stdout


def test_one_extraction_of_the_union_serves_all_jobs(sweep):
    root, _ = sweep
    extracts = [p for p in (root / "store" / "extract").iterdir() if not p.name.startswith(".")]
    assert len(extracts) == 1
    # n = 12: default [2, 6, 9], early [1, 3, 6], late [6, 9, 10], plus the final 12
    assert json.loads((extracts[0] / "capture_ids.json").read_text()) == [1, 2, 3, 6, 9, 10, 12]
    assert len([p for p in (root / "store" / "train").iterdir() if not p.name.startswith(".")]) == 9
    assert len([p for p in (root / "store" / "vocab").iterdir() if not p.name.startswith(".")]) == 3


def test_one_parent_with_nine_children_and_the_table(sweep):
    import mlflow

    from runner.tracking.sweep import comparison_rows

    root, stdout = sweep
    client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("eagle3")
    parents = client.search_runs(
        [exp.experiment_id], filter_string="tags.`sweep.config` = 'capture_x_vocab'"
    )
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0].info.run_id
    rows = comparison_rows(client, parent)
    assert len(rows) == 9 and all(r["status"] == "FINISHED" for r in rows)
    combos = {(r["model.capture_preset"], r["vocab.draft_vocab_size"]) for r in rows}
    assert combos == {
        (p, v) for p in ("default", "early", "late") for v in ("4096", "8192", "16384")
    }
    ids = {r["model.capture_preset"]: r["capture_ids"] for r in rows}
    assert ids == {"default": "[2, 6, 9, 12]", "early": "[1, 3, 6, 12]", "late": "[6, 9, 10, 12]"}
    assert all(r["vocab_coverage"] == 1.0 and r["train_loss"] > 0 for r in rows)
    # Exactly one job computed the extraction; the others reused it.
    assert sum("extract" in r["computed"].split(",") for r in rows) == 1
    arts = {a.path for a in client.list_artifacts(parent)}
    assert {"comparison.csv", "comparison.md", "comparison.json", "comparison.png"} <= arts
    # The parent says what was swept, as its description and its parameters.
    top = client.get_run(parent)
    note = top.data.tags["mlflow.note.content"]
    assert "**Sweep of 9 jobs** (9 finished)" in note and "no evaluation" in note
    assert "- `model.capture_preset`: default, early, late" in note
    assert top.data.params["swept.vocab.draft_vocab_size"] == "4096,8192,16384"
    # A real Markdown table: a header row, the separator row, one row per job.
    md = Path(client.download_artifacts(parent, "comparison.md")).read_text().splitlines()
    assert md[0].startswith("| ") and md[1].startswith("|---") and len(md) == 2 + 9
    assert all(line.startswith("| ") and line.endswith(" |") for line in md[2:])
    assert "sweep time" in stdout
    # Child runs are named after their overrides, so chart legends tell them apart; the end
    # of the sweep names the parent run and how to browse it.
    mine = f"tags.mlflow.parentRunId = '{parent}'"
    children = client.search_runs([exp.experiment_id], filter_string=mine)
    names = {c.info.run_name for c in children}
    assert len(names) == 9
    assert any(
        "model.capture_preset=late" in n and "vocab.draft_vocab_size=4096" in n for n in names
    )
    # Only the swept values, and first (MLflow's table cuts names short): the overrides all nine
    # jobs share would only repeat.
    assert not any("data.num_samples" in n or "model.source" in n for n in names), names
    assert all(n.split()[0].startswith(("model.capture_preset=", "vocab.")) for n in names), names
    # The plan as printed is among each run's artifacts.
    run = children[0]
    assert "plan.txt" in {a.path for a in client.list_artifacts(run.info.run_id)}
    assert f"sweep parent run {parent}" in stdout and "eagle3-runner ui --output-root" in stdout
    # One plan for the sweep and a line per job (each job's summary is its run's description).
    assert stdout.count("==== eagle3 runner: plan ====") == 1
    jobs = [ln for ln in stdout.splitlines() if ln.startswith("[job ")]
    assert [ln.split("]")[0] for ln in jobs] == [f"[job {i}" for i in range(9)]
    assert all("MLflow run " in ln and "computed" in ln for ln in jobs)


def test_report_prints_the_table_from_mlflow(sweep):
    root, _ = sweep
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    out = subprocess.run(
        [sys.executable, "-m", "runner.commands.report", "--output-root", str(root)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("sweep capture_x_vocab")
    assert sum(1 for line in lines if "[6, 9, 10, 12]" in line) == 3
    # The table fits 120 columns and names what it left out; --csv and --json hold everything.
    assert all(len(line) <= 120 for line in lines[1:]), max(lines[1:], key=len)
    assert "more column(s)" in out.stdout

    def report(*flags: str) -> str:
        cmd = [sys.executable, "-m", "runner.commands.report", "--output-root", str(root), *flags]
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    rows = json.loads(report("--json"))
    assert len(rows) == 9 and all("vocab_coverage" in r for r in rows)
    table = report("--csv").splitlines()
    assert len(table) == 10 and table[0].split(",")[: len(rows[0])] == list(rows[0])
    assert any(len(line) > 120 for line in report("--wide").splitlines())


def test_publishing_a_sweep_parent_without_an_evaluation_lists_its_children(sweep, tmp_path):
    """This sweep trained but evaluated nothing: there is no objective to pick its best child
    by, so `publish --run <parent>` is refused in one line naming the nine children."""
    import mlflow

    root, _ = sweep
    client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("eagle3")
    (parent,) = client.search_runs(
        [exp.experiment_id], filter_string="tags.`sweep.config` = 'capture_x_vocab'"
    )
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "runner.commands.publish",
            str(tmp_path / "out"),
            "--run",
            parent.info.run_id,
            "--output-root",
            str(root),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    children = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    assert "is a sweep's parent and none of its children was evaluated" in out.stderr
    assert all(c.info.run_id in out.stderr for c in children) and len(children) == 9
    assert not (tmp_path / "out").exists()


def test_a_failed_job_is_a_failed_child_and_the_parent_still_closes(
    tiny12_model_dir, chats_jsonl, tmp_path
):
    import mlflow

    from runner.tracking.sweep import comparison_rows

    # 60000 > 49152: that job fails in its checks, the other trains.
    proc = run_sweep(tiny12_model_dir, chats_jsonl, tmp_path, "vocab.draft_vocab_size=512,60000")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "vocab.draft_vocab_size" in proc.stderr
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("eagle3")
    parent = client.search_runs([exp.experiment_id], filter_string="tags.`sweep.config` != ''")[0]
    assert parent.info.status == "FAILED"
    rows = comparison_rows(client, parent.info.run_id)
    assert sorted(r["status"] for r in rows) == ["FAILED", "FINISHED"]


def test_parallel_jobs_compute_each_shared_artifact_once(tiny12_model_dir, chats_jsonl, tmp_path):
    """Four capture-layer jobs, two at a time through the joblib launcher: the lock per artifact
    key lets one job compute prepare, extract and vocab while the other waits and reuses them."""
    proc = run_sweep(
        tiny12_model_dir,
        chats_jsonl,
        tmp_path,
        "-cn",
        "capture_layers",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    counts = tuple(
        len([p for p in (tmp_path / "store" / stage).iterdir() if not p.name.startswith(".")])
        for stage in ("prepare", "extract", "vocab", "train")
    )
    assert counts == (1, 1, 1, 4)


def test_a_sweep_through_submitit_runs_each_job_as_its_own_process(
    tiny12_model_dir, chats_jsonl, tmp_path
):
    """The Slurm code path (hydra-submitit-launcher) without a cluster: submitit's local
    executor starts each job as a process; the jobs share one extraction through the store's
    locks, and the parent run holds both."""
    import mlflow

    from runner.tracking.sweep import comparison_rows

    proc = run_sweep(
        tiny12_model_dir,
        chats_jsonl,
        tmp_path,
        "train.lr=1e-3,3e-3",
        "hydra/launcher=submitit_local",
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Submitit 'local' sweep output dir" in proc.stdout + proc.stderr
    assert list((tmp_path / "hydra" / "multirun").glob("*/.submitit/*"))  # submitit's job folders
    counts = tuple(
        len([p for p in (tmp_path / "store" / stage).iterdir() if not p.name.startswith(".")])
        for stage in ("prepare", "extract", "vocab", "train")
    )
    assert counts == (1, 1, 1, 2)
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("eagle3")
    (parent,) = client.search_runs([exp.experiment_id], filter_string="tags.`sweep.config` != ''")
    assert parent.info.status == "FINISHED"
    rows = comparison_rows(client, parent.info.run_id)
    assert sorted(r["train.lr"] for r in rows) == ["0.001", "0.003"]
    assert all(r["status"] == "FINISHED" for r in rows)
    assert "run.stages" not in rows[0]  # a list value, not a swept key


def test_the_submitit_launcher_runs_a_two_node_job(tiny12_model_dir, chats_jsonl, tmp_path):
    """One job on two "nodes": submitit's local executor starts two tasks (as Slurm starts one a
    node with hydra/launcher=slurm, whose `nodes` is hardware.num_nodes); the task of rank 0 runs
    the pipeline, the other joins its training, each with one gloo rank."""
    from runner.serving.vllm_server import free_port

    proc = run_sweep(
        tiny12_model_dir,
        chats_jsonl,
        tmp_path,
        "hydra/launcher=submitit_local",
        "hydra.launcher.tasks_per_node=2",
        "hardware.num_nodes=2",
        f"hardware.rdzv_endpoint=127.0.0.1:{free_port()}",
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    logs = "".join(
        p.read_text(errors="replace")
        for p in (tmp_path / "hydra" / "multirun").glob("*/.submitit/*/*_log.*")
    )
    assert "joining attempt 1" in logs and "--nnodes=2" in logs, logs[-3000:]
    (art,) = [p for p in (tmp_path / "store" / "train").iterdir() if not p.name.startswith(".")]
    metrics = json.loads((art / "manifest.json").read_text())["metrics"]
    assert metrics["ranks"] == 2 and metrics["nodes"] == 2


def test_a_config_group_sweep_is_compared_by_its_options():
    """`-m regenerate=none,vllm` sweeps a config group, which is no param itself: each job's row
    (and the sweep figure's x axis) shows the option it ran, not an empty value."""
    from types import SimpleNamespace

    from runner.tracking.sweep import run_row

    def child(backend: str) -> SimpleNamespace:
        data = SimpleNamespace(params={"regenerate.backend": backend}, metrics={}, tags={})
        return SimpleNamespace(data=data, info=SimpleNamespace(run_id=backend, status="FINISHED"))

    rows = [run_row(child(b), ["regenerate"]) for b in ("none", "vllm")]
    assert [r["regenerate"] for r in rows] == ["none", "vllm"]


def test_a_command_line_sweeps_parent_is_named_by_what_it_sweeps():
    """Not by every override: the shared ones (local paths among them) are in its tags."""
    from runner.tracking.sweep import _swept_title

    line = [
        "model=hf",
        "model.source=/data/m",
        "model.capture_layers=[1,2,3]",
        "train.lr=1e-3,3e-3",
    ]
    assert _swept_title(line) == "train.lr=1e-3,3e-3"
    assert _swept_title(["vocab.draft_vocab_size=range(4096,8193,4096)", "x=[1,2],[3,4]"]) == (
        "vocab.draft_vocab_size=range(4096,8193,4096) x=[1,2],[3,4]"
    )
    assert _swept_title([]) == "defaults"


def test_a_signal_while_the_sweep_closes_waits_for_its_parent_to_close(monkeypatch, capsys):
    """SIGTERM (or a closed terminal) while the parent run is being closed: the closing ends
    first, then the sweep exits with the signal's code and a line that says so."""
    import os
    import signal

    from runner.tracking.sweep import SweepCallback

    closed = []

    def close(self, config):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives in the middle of the closing
        closed.append("parent closed")

    monkeypatch.setattr(SweepCallback, "_close", close)
    with pytest.raises(SystemExit) as stop:
        SweepCallback().on_multirun_end(config=None)
    assert stop.value.code == 143 and closed == ["parent closed"]
    assert "interrupted by SIGTERM while the sweep closed" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_sweeps_no_job_can_do_are_refused_before_the_first_job():
    """A key swept twice, a search with an empty space, or a search that is only planned: one
    line and exit 2 before any job or MLflow run."""
    from omegaconf import OmegaConf

    from runner.tracking.sweep import check_sweep

    optuna = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"

    def config(task, sweeper, plan_only=False):
        return OmegaConf.create(
            {
                "hydra": {"overrides": {"task": task}, "sweeper": sweeper},
                "run": {"plan_only": plan_only},
            }
        )

    for bad in (
        config(["train.lr=1e-3,3e-3", "train.lr=2e-3"], {}),
        config([], {"_target_": optuna, "params": {}}),
        config([], {"_target_": optuna, "params": {"train.lr": "interval(1e-4, 1e-2)"}}, True),
    ):
        with pytest.raises(SystemExit) as refused:
            check_sweep(bad)
        assert refused.value.code == 2
    assert check_sweep(config([], {"_target_": optuna, "params": {"train.lr": "range(1,3)"}}))
    assert not check_sweep(config(["train.lr=1e-3,3e-3", "train.epochs=1"], {}))


def test_a_planned_sweep_writes_no_mlflow_run_and_a_search_needs_an_objective(
    tiny12_model_dir, chats_jsonl, tmp_path
):
    planned = run_sweep(
        tiny12_model_dir, chats_jsonl, tmp_path / "p", "train.lr=1e-3,3e-3", "run.plan_only=true"
    )
    assert planned.returncode == 0, planned.stdout[-2000:] + planned.stderr[-2000:]
    assert planned.stdout.count("plan") >= 2 and not (tmp_path / "p" / "mlflow.db").exists()
    root = tmp_path / "s"
    search = run_sweep(
        tiny12_model_dir,
        chats_jsonl,
        root,
        "-cn",
        "search",
        "hydra.sweeper.n_trials=2",
        "run.stages=[prepare]",
    )
    assert search.returncode == 2 and "no stage of this run reports one" in search.stderr
    assert "Traceback" not in search.stderr
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("eagle3").experiment_id])
    parent = [r for r in runs if r.data.tags.get("sweep.config") == "search"]
    assert len(parent) == 1 and parent[0].info.status == "FAILED"
