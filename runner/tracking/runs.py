"""MLflow tracking for one runner job: the runner owns the run, stages log into it.

Default store: `sqlite:///<output_root>/mlflow.db` (absolute), artifacts in
`<output_root>/mlartifacts`; `tracking.uri` or MLFLOW_TRACKING_URI points elsewhere.
speculators' own MLflow logger (`--logger mlflow`) finds the active run and writes its
training metrics into it.

Browse with the command `Tracker.ui_command()` returns, e.g.
`eagle3-runner ui --output-root /abs/outputs` (runner/tracking/ui.py: MLflow's server, opening
experiments in its model-training view), then the run's page it names.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import sqlite3
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from filelock import FileLock

from runner.core.errors import ConfigError, StageError
from runner.core.layout import RunLayout
from runner.core.nested import flatten
from runner.core.schema import TrackingConfig

log = logging.getLogger(__name__)
# MLflow 3's UI opens an experiment in its GenAI view unless the experiment says it holds model
# training (the experiment kind its UI reads), and the address can ask for the training view.
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
# The experiment's primary metric (MLflow's own tags, mlflow.utils.mlflow_tags): the runs
# compared open on its chart, higher being better. Set to the run's objective (the acceptance
# length) unless the experiment names one already.
PRIMARY_METRIC_TAG = "mlflow.experiment.primaryMetric.name"
PRIMARY_GREATER_TAG = "mlflow.experiment.primaryMetric.greaterIsBetter"
UI_VIEW = "workflowType=machine_learning"
# The widest a logged figure is, in pixels (Tracker.log_figure).
FIGURE_MAX_PX = 720

# The user's own MLFLOW_TRACKING_URI, read before mlflow.set_tracking_uri (which exports the URI
# it is given to the environment) could make one job's store look like the user's choice to the
# next.
_USER_URI = os.environ.get("MLFLOW_TRACKING_URI")

# MLflow limits: 6000 characters per param value, 100 params per batch call.
_PARAM_MAX = 6000
_BATCH = 100


def tracking_uri(configured: str | None, output_root: Path) -> str:
    if configured:
        return configured
    if _USER_URI:
        return _USER_URI
    return f"sqlite:///{RunLayout(output_root).mlflow_db.resolve()}"


def process_start(pid: int) -> str:
    """When `pid` started (clock ticks since boot, /proc): with the pid, it names one process,
    even after the pid is reused."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def process_tags() -> dict[str, str]:
    """Who owns a run: a later run reconciles it if this process dies without closing it."""
    pid = os.getpid()
    return {
        "runner.host": socket.gethostname(),
        "runner.pid": str(pid),
        "runner.pid_start": process_start(pid),
    }


def _alive(pid: str | None, started: str | None) -> bool:
    """Whether the process that owns a run still runs (a reused pid has another start time)."""
    if not pid or not pid.isdigit():
        return True  # not the runner's own run: leave it alone
    now = process_start(int(pid))
    return now != "" and (not started or now == started)


@contextlib.contextmanager
def _sqlite_lock(uri: str) -> Iterator[None]:
    if not uri.startswith("sqlite:///"):
        yield
        return
    db = Path(uri[len("sqlite:///") :])
    db.parent.mkdir(parents=True, exist_ok=True)
    path = db.with_name(db.name + ".lock")
    lock = FileLock(str(path))
    with lock:
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                path.unlink()  # while held: a waiter then opens a fresh one (filelock checks)


# The schemes MLflow's tracking client serves; a database scheme also needs its driver.
TRACKING_SCHEMES = ("http", "https", "sqlite", "file", "", "databricks", "databricks-uc")
DATABASE_SCHEMES = ("postgresql", "mysql", "mssql")
SQLITE_HEADER = b"SQLite format 3\x00"


def check_store(uri: str, timeout_s: float, experiment: str | None = None) -> str | None:
    """Why the MLflow store at `uri` cannot be used, or None. An HTTP server must answer its
    /health endpoint within `timeout_s` (MLflow's own client retries for minutes); a SQLite or
    file store's folder must be writable, an existing SQLite file must be a database, and
    `experiment` must not be deleted there; a database URI needs its driver installed; a scheme
    MLflow cannot track to is refused."""
    import urllib.error
    import urllib.parse
    import urllib.request

    try:
        parsed = urllib.parse.urlparse(uri)
    except ValueError as exc:
        return f"not a valid URI ({exc})"
    scheme = parsed.scheme.split("+", 1)[0]
    if scheme in DATABASE_SCHEMES:
        return _database_driver(uri)
    if scheme not in TRACKING_SCHEMES:
        return (
            f"MLflow cannot track to a {parsed.scheme!r} URI; use http(s)://host:port, "
            "sqlite:////path/mlflow.db, a file folder, or a postgresql/mysql/mssql database"
        )
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
        path = Path(uri[len("sqlite:///") :]) if sqlite else Path(parsed.path)
        if sqlite and path.is_file():
            problem = _sqlite_store(path, experiment)
            if problem:
                return problem
        folder = path.parent if sqlite else path
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if not os.access(folder, os.W_OK | os.X_OK):
            return f"{folder} is not writable by this user"
    return None


def _database_driver(uri: str) -> str | None:
    """A database store needs SQLAlchemy's dialect and its driver here."""
    from sqlalchemy.engine import make_url  # MLflow's own dependency

    try:
        dialect = make_url(uri).get_dialect()
        (getattr(dialect, "import_dbapi", None) or dialect.dbapi)()  # imports the driver
    except Exception as exc:  # ArgumentError, NoSuchModuleError, ModuleNotFoundError
        return (
            f"this environment cannot open that database ({type(exc).__name__}: {exc}); "
            "install its driver (e.g. psycopg2-binary for postgresql, pymysql for mysql)"
        )
    return None


def _sqlite_store(path: Path, experiment: str | None) -> str | None:
    """An existing SQLite store: a whole database, where the experiment is not deleted."""
    damage = sqlite_damage(path)
    if damage or experiment is None:
        return damage
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            row = db.execute(
                "SELECT experiment_id, lifecycle_stage FROM experiments WHERE name = ?",
                (experiment,),
            ).fetchone()
    except sqlite3.Error:
        return None  # a database with no tables yet: MLflow creates them
    if row and row[1] == "deleted":
        return (
            f"experiment {experiment!r} is deleted in {path} (it stays until purged, and its name "
            f"with it): restore it (MLFLOW_TRACKING_URI=sqlite:///{path} mlflow experiments "
            f"restore --experiment-id {row[0]}) or set tracking.experiment to another name"
        )
    return None


def sqlite_damage(path: Path) -> str | None:
    """Why the existing SQLite file at `path` is not a whole MLflow store, or None. MLflow opens
    an empty (0-byte) file as a new store and writes a fresh schema into it, so a store whose
    contents were lost would be replaced without a word, its history gone: refused, like a file
    that is not SQLite, is shorter than its header says or whose schema cannot be read."""
    import sqlite3

    aside = (
        f"restore it from a backup, or move it aside (mv {path} {path}.damaged) to start a new "
        "store; the stage artifacts under store/ are kept either way"
    )
    try:
        with open(path, "rb") as fh:
            header = fh.read(100)
        size = path.stat().st_size
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    if not header:
        return f"the MLflow store {path} is empty (0 bytes): its runs are lost; {aside}"
    if not header.startswith(SQLITE_HEADER):
        return f"{path} is not an SQLite database (MLflow's store); move it away or pick another"
    # The header's own page count (valid when its change counter matches, offsets 24 and 92):
    # a file shorter than that was cut beneath SQLite. Read in microseconds, where a full
    # integrity check would read every page of a store that grows with every run.
    page = int.from_bytes(header[16:18], "big")
    page = 65536 if page == 1 else page
    pages = int.from_bytes(header[28:32], "big")
    if len(header) == 100 and header[24:28] == header[92:96] and size < pages * page:
        return (
            f"the MLflow store {path} is cut short ({size:,} of the {pages * page:,} bytes its "
            f"header declares); {aside}"
        )
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            db.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.DatabaseError as exc:
        return f"the MLflow store {path} is damaged ({exc}); {aside}"
    return None


def missing_store(uri: str) -> str | None:
    """For a read-only command (report, publish): why the store at `uri` cannot be read (a SQLite
    file that does not exist, or is empty or damaged: opening it would create a new one), or
    None."""
    if not uri.startswith("sqlite:///"):
        return None
    db = Path(uri[len("sqlite:///") :])
    if not db.is_file():
        return (
            f"no MLflow store at {db}; run from the folder that holds "
            "outputs/, or pass --output-root DIR or --tracking-uri URI"
        )
    return sqlite_damage(db)  # opening an emptied store would write a new one over it


def store_to_read(configured: str | None, output_root: Path) -> tuple[str, str | None]:
    """For a command that reads a root's runs (report, publish): the store's URI and why it
    cannot be read (None: it can). A readable root copied or moved here is first pointed at
    itself, so the command acts on this root's files."""
    uri = tracking_uri(configured, output_root)
    problem = missing_store(uri)
    if problem is None:
        follow_moved_root(uri, output_root)
    return uri, problem


def follow_moved_root(uri: str, output_root: Path) -> Path | None:
    """The root's own store, copied or moved here from another root, still names the old
    root's folders: point them here, so that a run, publish or report in this root reads and
    writes this root's files, never the other's. Returns the old root, or None."""
    from runner.integrations.mlflow_sqlite import repoint

    db = RunLayout(output_root).mlflow_db.resolve()
    if uri != f"sqlite:///{db}" or not db.is_file():
        return None
    try:
        old = repoint(db, output_root)
    except sqlite3.OperationalError as exc:  # read-only media: read it as it is
        log.warning(
            "this output root's MLflow store could not be pointed at %s (%s): its runs still "
            "name the root they were made in, and files are looked for under this one",
            output_root,
            exc,
        )
        return None
    if old is not None:
        log.warning(
            "this output root's MLflow store was made in %s (the root was copied or moved); "
            "its runs' artifact folders and stage paths now point here, %s",
            old,
            output_root,
        )
    return old


class Tracker:
    def __init__(
        self, tracking_cfg: TrackingConfig, output_root: Path, primary_metric: str | None = None
    ):
        """`primary_metric`: the metric the run is judged by (its objective's MLflow name), the
        experiment's primary metric unless it has one."""
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
        self.run_id: str | None = None
        self.figures: list[str] = []  # the figures logged, in order (figures_markdown)
        try:
            # Two first runs on a fresh root would both create and migrate the SQLite schema
            # (and could leave it half-migrated): one at a time.
            with _sqlite_lock(self.uri):
                self._follow_moved_root(output_root)
                self.experiment_id = self._experiment(
                    tracking_cfg.experiment, output_root, primary_metric
                )
        except Exception as exc:  # locked, unreachable, corrupt: say which store
            raise ConfigError(
                "tracking.uri", f"the MLflow store {self.uri} failed: {type(exc).__name__}: {exc}"
            ) from None
        self._reconcile()

    def _follow_moved_root(self, output_root: Path) -> None:
        follow_moved_root(self.uri, output_root)

    def _experiment(self, name: str, output_root: Path, primary: str | None) -> str:
        exp = self.mlflow.get_experiment_by_name(name)
        want = dict(EXPERIMENT_TAGS)
        if primary and (exp is None or PRIMARY_METRIC_TAG not in exp.tags):
            want |= {PRIMARY_METRIC_TAG: primary, PRIMARY_GREATER_TAG: "true"}
        if exp is None:
            artifact_location = None
            if self.uri.startswith("sqlite:"):
                artifact_location = RunLayout(output_root).mlflow_artifacts.resolve().as_uri()
            return self.mlflow.create_experiment(
                name, artifact_location=artifact_location, tags=want
            )
        # An experiment from before these tags gets them.
        missing = {k: v for k, v in want.items() if exp.tags.get(k) != v}
        client = self.mlflow.MlflowClient(self.uri)
        for k, v in missing.items():
            client.set_experiment_tag(exp.experiment_id, k, v)
        return exp.experiment_id

    def _reconcile(self) -> None:
        """Runs of this experiment left RUNNING by a runner on this host that no longer lives
        (killed with -9, or its end could not be written) are marked FAILED, with a note."""
        host = socket.gethostname()
        try:
            stale = self.mlflow.MlflowClient(self.uri).search_runs(
                [self.experiment_id],
                filter_string=f"attributes.status = 'RUNNING' and tags.`runner.host` = '{host}'",
                max_results=200,
            )
        except Exception as exc:  # reconciling is housekeeping: never a reason to stop
            log.warning("could not look for stale runs in %s: %s", self.uri, exc)
            return
        client = self.mlflow.MlflowClient(self.uri)
        for run in stale:
            tags = run.data.tags
            if _alive(tags.get("runner.pid"), tags.get("runner.pid_start")):
                continue
            when = time.strftime("%Y-%m-%d %H:%M:%S")
            note = (
                f"the runner (pid {tags.get('runner.pid')} on {host}) ended without closing this "
                f"run; marked FAILED by a later run at {when}"
            )
            with contextlib.suppress(Exception):
                client.set_tag(run.info.run_id, "runner.note", note)
                client.set_terminated(run.info.run_id, status="FAILED")
                log.warning("MLflow run %s: %s", run.info.run_id, note)

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

    def replay_curves(self, path: Path) -> None:
        """Step records ({"step": n, "train/loss": x, ...} per line) logged again as the series
        they were, for a run that reuses the artifact that holds them."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = []
        for line in path.read_text().splitlines():
            record = json.loads(line)
            step = int(record.pop("step", None) or 0)
            for k, v in record.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    batch.append(Metric(k, float(v), now, step))
        client = self.mlflow.MlflowClient(self.uri)
        for i in range(0, len(batch), 1000):
            client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def metrics(self) -> dict[str, float]:
        """The run's metrics as MLflow holds them (the latest value of each), once everything
        queued is written: logging is asynchronous (see __init__), and a read before the queue
        drains misses the newest metrics."""
        self.mlflow.flush_async_logging()
        return dict(self.mlflow.MlflowClient(self.uri).get_run(self.run_id).data.metrics)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self.mlflow.set_tags({k: str(v)[:5000] for k, v in tags.items()})

    @contextlib.contextmanager
    def _writing(self, what: str) -> Iterator[None]:
        """An OS error while MLflow copies into the run's artifact folder (a full disk, a
        read-only or foreign folder) ends the run with one line that names the folder."""
        try:
            yield
        except OSError as exc:
            try:
                where = self.mlflow.get_artifact_uri()
            except Exception:
                where = "the run's artifact folder"
            raise StageError(
                f"MLflow could not write {what} into {where}: {exc.strerror or exc}. Free space "
                "or fix the permissions there, or point tracking.uri elsewhere "
                "(tracking.log_checkpoint_max_mb limits what is copied)"
            ) from None

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        with self._writing(path.name):
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

    def log_table(self, rows: list[dict[str, Any]], artifact_file: str) -> None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
        data = {c: [r.get(c) for r in rows] for c in columns}
        with self._writing(artifact_file):
            self.mlflow.log_table(data=data, artifact_file=artifact_file)

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        """A figure, at most FIGURE_MAX_PX wide: the run's description shows it, and an image
        is as wide as its pixels there (a 1,000-pixel figure held the page's main column at
        1,000 px and pushed the side panel past a 1600 px screen)."""
        import matplotlib.pyplot as plt

        dpi = min(figure.get_dpi(), FIGURE_MAX_PX / figure.get_figwidth())
        try:
            with self._writing(artifact_file):
                self.mlflow.log_figure(figure, artifact_file, save_kwargs={"dpi": dpi})
            self.figures.append(artifact_file)
        finally:
            plt.close(figure)

    def figures_markdown(self) -> str:
        """The logged figures as markdown images for the run's description, so that its page
        shows them (the training loss among them) without a search through its ~130 charts;
        MLflow's own artifact address, relative to the UI's page."""
        from urllib.parse import quote

        return "".join(
            f"\n\n![{name}](get-artifact?path={quote(name, safe='')}&run_uuid={self.run_id})"
            for name in self.figures
        )

    def log_inputs(self, entries: list[Mapping[str, Any]]) -> None:
        """Datasets as MLflow run inputs (the run page's Datasets column): each entry's "name",
        "source" (a URL, a hub id, a local path, or another name such as package:sharegpt),
        "digest", "context" (training, evaluation), optional "rows", and optional "table" (a
        list of row dicts: what the stage read, e.g. each prompt): with a table the input is a
        pandas dataset (mlflow.data.from_pandas), so the UI shows its schema and profile."""
        import re

        from mlflow.data.code_dataset_source import CodeDatasetSource
        from mlflow.data.dataset_source_registry import resolve_dataset_source
        from mlflow.data.http_dataset_source import HTTPDatasetSource
        from mlflow.data.meta_dataset import MetaDataset

        for e in entries:
            where = str(e["source"])
            if where.startswith(("http://", "https://")):
                source: Any = HTTPDatasetSource(where)
            elif Path(where).expanduser().exists():
                source = resolve_dataset_source(str(Path(where).expanduser().resolve()))
            elif re.fullmatch(r"[\w.-]+/[\w.-]+", where):  # a hub id
                source = HTTPDatasetSource(f"https://huggingface.co/datasets/{where}")
            else:
                source = CodeDatasetSource({"source": where})
            tags = {"rows": str(e["rows"])} if e.get("rows") is not None else None
            name, digest = str(e["name"]), str(e["digest"])[:36]
            if e.get("table"):
                import pandas as pd
                from mlflow.data.pandas_dataset import from_pandas

                dataset: Any = from_pandas(
                    pd.DataFrame(list(e["table"])), source=source, name=name, digest=digest
                )
            else:
                dataset = MetaDataset(source=source, name=name, digest=digest)
            self.mlflow.log_input(dataset, context=str(e["context"]), tags=tags)

    def register_draft(
        self, name: str, folder: Path, description: str, tags: Mapping[str, str]
    ) -> str:
        """The served draft as an MLflow logged model of this run (its files in the store, so
        the experiment's Models tab lists it and a copied root carries it), registered as a
        version of `name` from the model's own `models:/` address. Drafts with the same weights
        (a sweep over evaluation settings) are one version: the existing one is returned."""
        import hashlib

        client = self.mlflow.MlflowClient(self.uri)
        digest = hashlib.sha256()
        for f in sorted(p for p in folder.rglob("*") if p.is_file()):
            digest.update(f.relative_to(folder).as_posix().encode())
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
        weights = digest.hexdigest()
        try:
            client.get_registered_model(name)
        except Exception:  # MLflow raises RESOURCE_DOES_NOT_EXIST for a new name
            client.create_registered_model(
                name, description="EAGLE-3 drafts trained by eagle3-runner"
            )
        same = client.search_model_versions(f"name='{name}' and tags.weights_sha256='{weights}'")
        if same:
            return str(same[0].version)
        tags = {k: str(v)[:5000] for k, v in {**tags, "weights_sha256": weights}.items()}
        model = client.create_logged_model(
            experiment_id=self.experiment_id, name="draft", source_run_id=self.run_id, tags=tags
        )
        client.log_model_artifacts(model.model_id, str(folder))
        client.finalize_logged_model(model.model_id, "READY")
        version = self.mlflow.register_model(f"models:/{model.model_id}", name, tags=tags)
        client.update_model_version(name, version.version, description=description[:5000])
        return str(version.version)

    def set_description(self, text: str) -> None:
        """The run's description (markdown), shown at the top of its page in the MLflow UI."""
        self.mlflow.set_tag("mlflow.note.content", text)

    def log_text(self, text: str, artifact_file: str) -> None:
        with self._writing(artifact_file):
            self.mlflow.log_text(text, artifact_file)

    def ui_command(self) -> str:
        return ui_command(self.uri, self.experiment_id, self.run_id)


def description_markdown(text: str) -> str:
    """A run's summary as Markdown that wraps on its MLflow page: each line an inline code span
    (monospaced, but wrapping at its spaces) ending in a hard line break, indentation kept as
    non-breaking spaces. A code block would not wrap: its longest line (the 300-character serve
    command) widened the page to 4,200 px and pushed the side panel (status, datasets,
    registered model) off a 1600 px screen."""
    out = []
    for line in text.splitlines():
        body = line.strip()
        if not body:
            out.append("")
            continue
        indent = "&nbsp;" * (len(line) - len(line.lstrip()))
        tick = "``" if "`" in body else "`"
        pad = " " if body.startswith("`") or body.endswith("`") else ""
        out.append(f"{indent}{tick}{pad}{body}{pad}{tick}  ")
    return "\n".join(out)


def description_text(markdown: str) -> str:
    """The summary again, from a run's description (`report` prints it): the lines before the
    figures, code spans and indentation undone; a description written as one code block (runs
    of earlier versions) is read too."""
    import re

    if markdown.startswith("```"):
        return markdown.removeprefix("```").split("```")[0].strip("\n")
    lines = []
    for line in markdown.split("\n\n![")[0].splitlines():
        line = line.rstrip()
        indent = 0
        while line.startswith("&nbsp;"):
            line, indent = line[len("&nbsp;") :], indent + 1
        span = re.fullmatch(r"(`+) ?(.*?) ?\1", line)
        lines.append(" " * indent + (span.group(2) if span else line))
    return "\n".join(lines).strip("\n")


def ui_command(uri: str, experiment_id: str | None, run_id: str | None) -> str:
    """How to see a run: the UI command, then the run's page in MLflow's model-training view
    (the `workflowType` the UI reads from the address; it opens in its GenAI view otherwise)."""
    page = f"#/experiments/{experiment_id}/runs/{run_id}?{UI_VIEW}"
    if uri.startswith(("http://", "https://")):
        return f"open {uri.rstrip('/')}/{page}"
    db = Path(uri.removeprefix("sqlite:///"))
    store = (
        f"--output-root {db.parent}"
        if uri.startswith("sqlite:///") and db.name == RunLayout(db.parent).mlflow_db.name
        else f"--tracking-uri {uri}"
    )
    return f"eagle3-runner ui {store}, then open http://127.0.0.1:5000/{page}"


def registered_name(registered_model: str | None, model_name: str) -> tuple[str, str]:
    """(the registered model a served draft becomes a version of, the key that sets it)."""
    if registered_model:
        return registered_model, "tracking.registered_model"
    return f"eagle3-{model_name}", "model.name"


def registry_name_problem(name: str) -> str | None:
    """Why MLflow's registry would refuse `name`, asked of MLflow's own validation (the rule
    is MLflow's: no '/' or ':', no path-like parts), or None."""
    try:
        from mlflow.utils.validation import _validate_model_name  # MLflow's own rule
    except ImportError:  # a future MLflow without it: its registry still says so, later
        return None
    try:
        _validate_model_name(name)
    except Exception as exc:
        return str(getattr(exc, "message", exc)).splitlines()[0]
    return None


def here(path: Path, output_root: Path) -> Path:
    """A path a run recorded (a stage's artifact, <root>/store/...) as it lies in this root: the
    recorded one where it exists, else the same place under `output_root` (a copy of the root
    whose store could not be rewritten, e.g. on read-only media)."""
    if path.exists() or "store" not in path.parts:
        return path
    moved = output_root.joinpath(*path.parts[path.parts.index("store") :])
    return moved if moved.exists() else path
