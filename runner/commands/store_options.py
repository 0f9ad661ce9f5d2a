"""What the commands that read a root's runs (publish, report) take alike: the MLflow store, the
output root and the experiment, and their description from their docstring's first sentence."""

from __future__ import annotations

import argparse

from runner.core.layout import default_root


def parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """A parser for `eagle3-runner <prog>`, described by `doc`'s first sentence (up to the colon
    before its usage line) as a sentence."""
    about = (doc or "").split("\n\n")[0].split(":\n")[0].rstrip(":. ") + "."
    return argparse.ArgumentParser(prog=f"eagle3-runner {prog}", description=about)


def add_store_options(ap: argparse.ArgumentParser) -> None:
    """--tracking-uri, --output-root and --experiment, with their defaults."""
    ap.add_argument(
        "--tracking-uri",
        help="the MLflow store (default: $MLFLOW_TRACKING_URI, else the output root's mlflow.db)",
    )
    ap.add_argument(
        "--output-root",
        default=default_root(),
        help="the runs' output root (default: $EAGLE3_RUNNER_HOME, else ./outputs)",
    )
    ap.add_argument("--experiment", default="eagle3", help="the MLflow experiment (eagle3)")
