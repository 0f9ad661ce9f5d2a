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


def test_everything_else_is_mlflows_own(client):
    answer = client.get("/health")
    assert answer.status_code == 200 and ui.SCRIPT not in answer.get_data(as_text=True)
    api = client.get("/ajax-api/2.0/mlflow/experiments/search?max_results=1")
    assert "<script>" not in api.get_data(as_text=True)


def test_a_root_without_runs_is_refused_with_the_option_to_change(tmp_path, capsys):
    assert ui.main(["--output-root", str(tmp_path)]) == 2
    assert "--output-root" in capsys.readouterr().err


def test_the_address_is_printed_when_the_server_answers_and_sigterm_ends_it_all(tmp_path):
    """The UI's address comes once MLflow's server answers (it took a minute or more to start,
    after the address was printed); SIGTERM to the command ends the server and its workers and
    frees the port."""
    import os
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    import mlflow

    from runner.serving.vllm_server import free_port
    from tests.conftest import REPO

    mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").create_experiment("eagle3")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", "ui", "--output-root", str(tmp_path), "--port", str(port)],
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
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            assert r.status == 200  # answering by the time the address is read
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
