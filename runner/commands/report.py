"""Print a sweep's comparison table, or one run's results, from MLflow:
`python -m runner.commands.report [RUN_ID]`. The table fits 120 columns (`--wide` for all of them);
`--csv` and `--json` print every column for a spreadsheet or a script.

RUN_ID may be a sweep's parent run (its jobs are compared) or any single run (its row alone).
Without an id, the newest run of the experiment is shown: a sweep parent if it is one. The
store is only read (a copied or moved root's records are first pointed at it): a missing one is
an error, never created. Options:
    --tracking-uri URI   (default: $MLFLOW_TRACKING_URI, else sqlite:///<output root>/mlflow.db)
    --output-root DIR    (default: $EAGLE3_RUNNER_HOME, else ./outputs)
    --experiment NAME    (default: eagle3)
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

from runner.commands.store_options import add_store_options, parser
from runner.tracking.runs import description_text, store_to_read
from runner.tracking.sweep import TABLE_WIDTH, comparison_rows, render_table, run_row


def main(argv: list[str] | None = None) -> int:
    ap = parser("report", __doc__)
    ap.add_argument("parent", nargs="?", help="a run or sweep parent id (default: the newest)")
    ap.add_argument("--run", dest="run_id", help="the same as RUN_ID (publish's name for it)")
    add_store_options(ap)
    form = ap.add_mutually_exclusive_group()
    form.add_argument("--wide", action="store_true", help="every column, however wide")
    form.add_argument("--csv", action="store_true", help="the rows as CSV, every column")
    form.add_argument("--json", action="store_true", help="the rows as JSON, every column")
    args = ap.parse_args(argv)
    args.parent = args.parent or args.run_id
    root = Path(args.output_root).expanduser().resolve()
    uri, problem = store_to_read(args.tracking_uri, root)
    if problem:  # --output-root or --tracking-uri names no store this command can read
        print(f"report: {problem}", file=sys.stderr)
        return 2
    import mlflow  # seconds to import; after the cheap checks

    client = mlflow.MlflowClient(uri)
    run_id = args.parent
    if run_id is None:
        exp = client.get_experiment_by_name(args.experiment)
        newest = (
            client.search_runs(
                [exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=200
            )
            if exp
            else []
        )
        # A sweep's jobs are shown through their parent.
        runs = [r for r in newest if "mlflow.parentRunId" not in r.data.tags]
        if not runs:
            print(f"no run in experiment {args.experiment!r} at {uri}", file=sys.stderr)
            return 1
        run_id = runs[0].info.run_id
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException:
        print(f"report: no run {run_id} in {uri}", file=sys.stderr)
        return 2
    tags = run.data.tags
    sweep = "sweep.config" in tags
    rows = comparison_rows(client, run_id) if sweep else [run_row(run, [])]
    if args.csv or args.json:
        _machine(rows, "csv" if args.csv else "json")
        return 0
    width = None if args.wide else TABLE_WIDTH
    if sweep:
        print(
            f"sweep {tags.get('sweep.config', '?')} ({run_id}, {run.info.status}): "
            f"{tags.get('sweep.overrides', '')}"
        )
        print(render_table(rows, width))
    else:
        print(f"run {tags.get('mlflow.runName', '')} ({run_id}, {run.info.status})")
        print(render_table(rows, width))
        note = tags.get("mlflow.note.content")
        if note:  # the summary (the figures' images after it are for the UI)
            print(description_text(note))
        for line in estimate_lines(run.data.metrics):
            print(line)
    return 0


def estimate_lines(metrics: dict[str, float]) -> list[str]:
    """The plan's estimate of each computed stage beside its measured time (a CPU run's
    time/<stage>_estimate_s and time/<stage>_s), with the error; [] when the run has none."""
    stages = [k[5 : -len("_estimate_s")] for k in metrics if k.endswith("_estimate_s")]
    if not stages:
        return []
    lines = ["estimated against measured (this machine's probe; time/<stage>_estimate_s):"]
    lines.append(f"  {'stage':<10} {'estimate':>10} {'measured':>10} {'error':>7}")
    for name in stages:
        est, took = metrics[f"time/{name}_estimate_s"], metrics.get(f"time/{name}_s")
        if took is None:
            continue
        err = f"{(est - took) / took:+.0%}" if took > 0 else "-"
        lines.append(f"  {name:<10} {est:>9.0f}s {took:>9.0f}s {err:>7}")
    return lines


def _machine(rows: list[dict[str, Any]], form: str) -> None:
    """Every column of every row on stdout, for a spreadsheet or a script."""
    if form == "json":
        print(json.dumps(rows, indent=2, default=str))
        return
    cols = list(dict.fromkeys(c for r in rows for c in r))
    writer = csv.DictWriter(sys.stdout, fieldnames=cols, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
