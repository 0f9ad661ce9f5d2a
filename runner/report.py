"""Print a sweep's comparison table from MLflow: `python -m runner.report [PARENT_RUN_ID]`.

Without an id, the newest sweep parent run of the experiment is shown. Options:
    --tracking-uri URI   (default: $MLFLOW_TRACKING_URI, else sqlite:///<output root>/mlflow.db)
    --output-root DIR    (default: $EAGLE3_RUNNER_HOME, else ./outputs)
    --experiment NAME    (default: eagle3)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import mlflow

from runner.sweep import comparison_rows, render_table
from runner.tracking import tracking_uri


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m runner.report", description=__doc__.splitlines()[0]
    )
    ap.add_argument("parent", nargs="?", help="sweep parent run id (default: the newest sweep)")
    ap.add_argument("--tracking-uri")
    ap.add_argument("--output-root", default=os.environ.get("EAGLE3_RUNNER_HOME", "outputs"))
    ap.add_argument("--experiment", default="eagle3")
    args = ap.parse_args(argv)
    uri = tracking_uri(args.tracking_uri, Path(args.output_root).expanduser().resolve())
    client = mlflow.MlflowClient(uri)
    parent = args.parent
    if parent is None:
        exp = client.get_experiment_by_name(args.experiment)
        runs = (
            client.search_runs(
                [exp.experiment_id],
                filter_string="tags.`sweep.config` != ''",
                order_by=["attributes.start_time DESC"],
                max_results=1,
            )
            if exp
            else []
        )
        if not runs:
            print(f"no sweep found in experiment {args.experiment!r} at {uri}", file=sys.stderr)
            return 1
        parent = runs[0].info.run_id
    run = client.get_run(parent)
    print(
        f"sweep {run.data.tags.get('sweep.config', '?')} ({parent}, {run.info.status}): "
        f"{run.data.tags.get('sweep.overrides', '')}"
    )
    print(render_table(comparison_rows(client, parent)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
