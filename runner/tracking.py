"""MLflow tracking for one runner job: the runner owns the run, stages log into it.

Default store: `sqlite:///<output_root>/mlflow.db` (absolute), artifacts in
`<output_root>/mlartifacts`; `tracking.uri` or MLFLOW_TRACKING_URI points elsewhere.
speculators' own MLflow logger (`--logger mlflow`) finds the active run and writes its
training metrics into it.

Browse with the command `Tracker.ui_command()` returns, e.g.
`mlflow ui --backend-store-uri sqlite:////abs/outputs/mlflow.db`.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runner.schema import TrackingConfig

log = logging.getLogger(__name__)

# The user's own MLFLOW_TRACKING_URI, read before mlflow.set_tracking_uri (which exports the URI
# it is given to the environment) could make one job's store look like the user's choice to the
# next.
_USER_URI = os.environ.get("MLFLOW_TRACKING_URI")

# MLflow limits: 6000 characters per param value, 100 params per batch call.
_PARAM_MAX = 6000
_BATCH = 100


def flatten(d: Mapping[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1} (MLflow params) or, with sep="/", {"a/b": 1} (metrics)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + sep, sep))
        else:
            out[key] = v
    return out


def tracking_uri(configured: str | None, output_root: Path) -> str:
    if configured:
        return configured
    if _USER_URI:
        return _USER_URI
    return f"sqlite:///{(output_root / 'mlflow.db').resolve()}"


def check_store(uri: str, timeout_s: float) -> str | None:
    """Why the MLflow store at `uri` cannot be used, or None. An HTTP server must answer its
    /health endpoint within `timeout_s` (MLflow's own client retries for minutes); a SQLite or
    file store's folder must be writable. Other schemes are not checked."""
    import urllib.error
    import urllib.parse
    import urllib.request

    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme in ("http", "https"):
        try:
            urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s).close()
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                return f"the server refused the credentials (HTTP {exc.code})"
            return f"no MLflow server there: HTTP {exc.code} on /health"
        except (OSError, ValueError) as exc:  # refused, unresolvable, timed out
            reason = getattr(exc, "reason", exc)
            return f"unreachable within {timeout_s:g} s (tracking.connect_timeout_s): {reason}"
        return None
    if parsed.scheme in ("sqlite", "file", ""):
        # sqlite:////abs/mlflow.db -> /abs/mlflow.db; sqlite:///rel.db -> rel.db (relative)
        sqlite = parsed.scheme == "sqlite"
        folder = Path(uri[len("sqlite:///") :]).parent if sqlite else Path(parsed.path)
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if not os.access(folder, os.W_OK | os.X_OK):
            return f"{folder} is not writable by this user"
    return None


class Tracker:
    def __init__(self, tracking_cfg: TrackingConfig, output_root: Path):
        import mlflow  # seconds to import; only runs that track need it

        self.mlflow = mlflow
        self.uri = tracking_uri(tracking_cfg.uri, output_root)
        mlflow.set_tracking_uri(self.uri)
        # speculators logs every training step; written synchronously to SQLite that cost ~5% of
        # CPU training throughput (benchmarks/train_bench.py). Queue them; end_run flushes.
        mlflow.config.enable_async_logging(True)
        # speculators' MLflow logger reads the experiment from this variable when it has to
        # start a run itself; the runner always has one active, but keep them consistent.
        os.environ["MLFLOW_EXPERIMENT_NAME"] = tracking_cfg.experiment
        exp = mlflow.get_experiment_by_name(tracking_cfg.experiment)
        if exp is None:
            artifact_location = None
            if self.uri.startswith("sqlite:"):
                artifact_location = (output_root / "mlartifacts").resolve().as_uri()
            exp_id = mlflow.create_experiment(
                tracking_cfg.experiment, artifact_location=artifact_location
            )
        else:
            exp_id = exp.experiment_id
        self.experiment_id = exp_id
        self.run_id: str | None = None

    def start(self, run_name: str, tags: dict[str, str]) -> str:
        run = self.mlflow.start_run(experiment_id=self.experiment_id, run_name=run_name, tags=tags)
        self.run_id = run.info.run_id
        return self.run_id

    def end(self, status: str = "FINISHED") -> None:
        if self.mlflow.active_run() is not None:
            self.mlflow.end_run(status=status)
        # Leave the environment as the user had it (child processes of later jobs inherit it).
        if _USER_URI is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = _USER_URI

    def log_params(self, params: Mapping[str, Any]) -> None:
        items = [(k, str(v)[:_PARAM_MAX]) for k, v in flatten(params).items()]
        for i in range(0, len(items), _BATCH):
            self.mlflow.log_params(dict(items[i : i + _BATCH]))

    def log_metrics(
        self, metrics: Mapping[str, Any], prefix: str = "", step: int | None = None
    ) -> None:
        clean = {}
        for k, v in flatten(metrics).items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if math.isfinite(v):
                clean[f"{prefix}{k}"] = float(v)
        if clean:
            self.mlflow.log_metrics(clean, step=step)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self.mlflow.set_tags({k: str(v)[:5000] for k, v in tags.items()})

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        if path.is_dir():
            self.mlflow.log_artifacts(str(path), artifact_path=artifact_path)
        else:
            self.mlflow.log_artifact(str(path), artifact_path=artifact_path)

    def log_or_link(self, path: Path, artifact_path: str, max_mb: float) -> None:
        """Copy a file or folder into the run; above `max_mb` (tracking.log_checkpoint_max_mb)
        record its path as a tag instead, so a large checkpoint is not duplicated."""
        files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
        size_mb = sum(f.stat().st_size for f in files) / 2**20
        if size_mb <= max_mb:
            self.log_artifact(path, artifact_path=artifact_path)
            return
        self.set_tags({f"linked.{artifact_path}/{path.name}": str(path)})
        log.info(
            "%s is %.0f MB > tracking.log_checkpoint_max_mb; linked, not copied", path, size_mb
        )

    def log_text(self, text: str, artifact_file: str) -> None:
        self.mlflow.log_text(text, artifact_file)

    def ui_command(self) -> str:
        if self.uri.startswith(("http://", "https://")):
            return f"open {self.uri}"
        return f"mlflow ui --backend-store-uri {self.uri}"
