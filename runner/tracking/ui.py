"""MLflow's UI on the runner's store, opening on the results: `eagle3-runner ui`.

    eagle3-runner ui [--output-root DIR | --tracking-uri URI] [--host H] [--port P]

MLflow 3 opens an experiment in its GenAI view (traces, "Detect Issues") unless the browser has
chosen "Model training" once: the UI keeps that choice in the browser's localStorage
(`mlflow.workflowType_v1`), and the server has no setting for it. This command runs MLflow's own
server (`mlflow server`) with MLflow's extension point for server apps (`--app-name`, the
`mlflow.app` entry point of pyproject.toml): `create_app` is MLflow's app with one hook that
adds to its page a line of script choosing "Model training" (and MLflow's Assistant panel
closed) for a browser that has not chosen yet. A user's own choice stays theirs; nothing else of
MLflow changes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from runner.core.interrupts import handling

# The name of the entry point in pyproject.toml's [project.entry-points."mlflow.app"].
APP_NAME = "eagle3-runner"
# MLflow's key for the browser's chosen view, and the value of its model-training view
# (mlflow/server/js: useLocalStorage({key: "mlflow.workflowType", version: 1}), JSON values).
VIEW_KEY = "mlflow.workflowType_v1"
VIEW_VALUE = "machine_learning"
# What a browser that has chosen nothing gets: the model-training view, and MLflow's Assistant
# panel closed. MLflow 3.17 opens that panel on a browser's first visit, 400 px of a chat with an
# LLM provider the runner's machines rarely have, which pushed the run page's side panel
# (status, datasets, registered models) past a 1600 px screen; its button still opens it.
DEFAULTS = {
    VIEW_KEY: VIEW_VALUE,
    "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": True,
    "mlflow.assistant.panelOpen_v1": False,
}
SCRIPT = (
    "<script>try{"
    + "".join(
        f'if(localStorage.getItem("{k}")===null)localStorage.setItem("{k}",{json.dumps(json.dumps(v))});'
        for k, v in DEFAULTS.items()
    )
    + "}catch(e){}</script>"
)


def model_training_first(response: Any) -> Any:
    """Flask after-request hook: MLflow's page (index.html) with SCRIPT in its head."""
    if response.mimetype != "text/html" or response.status_code != 200:
        return response
    # MLflow sends the page as a file (send_from_directory): read it through to edit it.
    response.direct_passthrough = False
    page = response.get_data(as_text=True)
    if "</head>" in page and VIEW_KEY not in page:
        response.set_data(page.replace("</head>", SCRIPT + "</head>", 1))
    return response


def create_app() -> Any:
    """MLflow's server app (FastAPI around its Flask app), the Flask app hooked: what
    `mlflow server --app-name eagle3-runner` serves."""
    from mlflow.server import app as flask_app
    from mlflow.server.fastapi_app import create_fastapi_app

    if model_training_first not in flask_app.after_request_funcs.get(None, []):
        flask_app.after_request(model_training_first)
    return create_fastapi_app(flask_app)


def server_command(uri: str, artifacts: Path | None, host: str, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "mlflow", "server", "--app-name", APP_NAME]
    cmd += ["--backend-store-uri", uri, "--host", host, "--port", str(port)]
    if artifacts is not None:
        cmd += ["--default-artifact-root", str(artifacts)]
    return cmd


def main(argv: list[str] | None = None) -> int:
    from runner.core.layout import RunLayout, default_root
    from runner.tracking.runs import store_to_read

    ap = argparse.ArgumentParser(
        prog="eagle3-runner ui",
        description="MLflow's UI on the runner's store, opening experiments in Model training",
    )
    ap.add_argument(
        "--output-root",
        type=Path,
        default=Path(default_root()),
        metavar="DIR",
        help="run.output_root (default: $EAGLE3_RUNNER_HOME, else ./outputs)",
    )
    ap.add_argument("--tracking-uri", default=None, help="tracking.uri of the runs, if set")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=5000)
    args = ap.parse_args(argv)
    layout = RunLayout(args.output_root.expanduser().resolve())
    if args.tracking_uri is None and not layout.mlflow_db.is_file():
        print(
            f"no runs at {layout.root} (no {layout.mlflow_db.name}): pass --output-root, the "
            "run.output_root the runs used",
            file=sys.stderr,
        )
        return 2
    # A root copied or moved here is pointed at itself first, as report and publish do: its
    # runs' artifacts are then this root's files, shown with the original gone.
    uri, problem = store_to_read(args.tracking_uri, layout.root)
    if problem is not None:
        print(f"ui: {uri}: {problem}", file=sys.stderr)
        return 2
    cmd = server_command(uri, layout.mlflow_artifacts, args.host, args.port)
    url = f"http://{args.host}:{args.port}"
    print(f"starting MLflow's server on {uri} ...", flush=True)
    # Its own process group (it starts workers), ended with this command however it ends:
    # Ctrl-C, SIGTERM or a closed terminal here, and the kernel's SIGTERM if this is killed.
    server = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_end_with_us)
    stop = _stopper(server)
    try:

        def ended(signum: int, _frame: Any) -> None:
            # The server is stopped in `finally`, once the wait this interrupts has let go of
            # the process (a second wait from a handler would block on the first's lock).
            raise SystemExit(128 + signum)

        with handling((signal.SIGTERM, signal.SIGHUP), ended):
            t0 = time.time()
            if _answers(url, server):
                print(
                    f"MLflow UI at {url} (ready in {time.time() - t0:.0f} s; Ctrl-C stops it)",
                    flush=True,
                )
            return server.wait() if server.poll() is None else server.returncode
    except KeyboardInterrupt:
        return 0
    finally:
        stop()


def _end_with_us() -> None:
    from runner.core.interrupts import die_with_parent

    die_with_parent(signal.SIGTERM)


def _stopper(server: subprocess.Popen) -> Any:
    def stop() -> None:
        if server.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()

    return stop


def _answers(url: str, server: subprocess.Popen, timeout_s: float = 300.0) -> bool:
    """Waits until the server answers its health check (what a browser would meet: the page
    then loads), or it exits; the URL is printed only then."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


if __name__ == "__main__":
    sys.exit(main())
