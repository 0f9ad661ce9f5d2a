"""`eagle3-runner ui` (runner/tracking/ui.py): MLflow's own server app, registered as an
`mlflow.app` entry point, whose page chooses the model-training view for a browser that has
chosen none, and leaves everything else of MLflow as it is."""

from __future__ import annotations

import importlib.metadata

import pytest

from runner.tracking import ui


def test_mlflow_finds_the_app_by_its_name():
    apps = {e.name: e.value for e in importlib.metadata.entry_points(group="mlflow.app")}
    assert apps.get(ui.APP_NAME) == "runner.tracking.ui:create_app"
    from mlflow.server import _find_app, _is_factory

    assert _is_factory(_find_app(ui.APP_NAME))  # what `mlflow server --app-name` runs


@pytest.fixture(scope="module")
def client():
    from mlflow.server import app as flask_app

    ui.create_app()
    ui.create_app()  # a second call does not hook twice
    assert flask_app.after_request_funcs[None].count(ui.model_training_first) == 1
    return flask_app.test_client()


def test_the_page_chooses_model_training_unless_the_browser_chose(client):
    page = client.get("/").get_data(as_text=True)
    assert page.count(ui.SCRIPT) == 1 and page.index(ui.SCRIPT) < page.index("</head>")
    # Only where nothing is stored: a user's own choice stays.
    assert 'localStorage.getItem("mlflow.workflowType_v1")===null' in ui.SCRIPT
    # MLflow's Assistant panel closed unless the browser opened it (it took 400 px of the run
    # page); its button still opens it.
    assert 'localStorage.getItem("mlflow.assistant.panelOpen_v1")===null' in ui.SCRIPT
    assert 'setItem("mlflow.assistant.panelOpen_v1","false")' in ui.SCRIPT


def test_everything_else_is_mlflows_own(client):
    answer = client.get("/health")
    assert answer.status_code == 200 and ui.SCRIPT not in answer.get_data(as_text=True)
    api = client.get("/ajax-api/2.0/mlflow/experiments/search?max_results=1")
    assert "<script>" not in api.get_data(as_text=True)


def test_a_root_without_runs_is_refused_with_the_option_to_change(tmp_path, capsys):
    assert ui.main(["--output-root", str(tmp_path)]) == 2
    assert "--output-root" in capsys.readouterr().err


def test_a_moved_root_is_served_from_where_it_is_and_sigterm_ends_it_all(tmp_path):
    """On a root moved elsewhere, the original gone, MLflow lists a run's artifacts and serves
    their bytes from the moved root (its store is pointed there before the server starts). The
    UI's address comes once MLflow's server answers (it took a minute or more to start, after
    the address was printed); SIGTERM to the command ends the server and its workers and frees
    the port."""
    import json
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import time
    import urllib.parse
    import urllib.request

    import mlflow

    from runner.core.schema import TrackingConfig
    from runner.serving.vllm_server import free_port
    from runner.tracking.runs import Tracker
    from tests.conftest import REPO

    original, moved = tmp_path / "original", tmp_path / "moved"
    sample = tmp_path / "sample.txt"
    sample.write_text("the first row, as prepare renders it\n")
    tracker = Tracker(TrackingConfig(), original)
    try:
        run_id = tracker.start("a run", {})
        tracker.log_artifact(sample, artifact_path="prepare")
    finally:
        tracker.end()
        mlflow.end_run()
    shutil.copytree(original, moved, symlinks=True)
    shutil.rmtree(original)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", "ui", "--output-root", str(moved), "--port", str(port)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("MLflow UI at"):
                break
        else:
            raise AssertionError("the address was never printed")
        url = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            assert r.status == 200  # answering by the time the address is read
        q = urllib.parse.urlencode({"run_id": run_id, "path": "prepare"})
        with urllib.request.urlopen(f"{url}/ajax-api/2.0/mlflow/artifacts/list?{q}") as r:
            listed = {f["path"] for f in json.loads(r.read()).get("files", [])}
        assert listed == {"prepare/sample.txt"}
        q = urllib.parse.urlencode({"run_uuid": run_id, "path": "prepare/sample.txt"})
        with urllib.request.urlopen(f"{url}/get-artifact?{q}") as r:
            assert r.read() == sample.read_bytes()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        t0 = time.time()
        while time.time() - t0 < 15:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            except OSError:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("MLflow's server outlived the command")
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
