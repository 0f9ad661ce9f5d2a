"""Draft-training throughput through the runner against speculators' trainer called directly on
the same files, measured in one run (same machine, one after the other).

Usage: EAGLE3_RUNNER_HOME=<root with a finished default run> \
    python -m benchmarks.train_bench --steps 60
1. runner:  `python -m runner run.stages=[train] run.force=[train] train.max_steps=N train.epochs=1`
2. direct:  the `speculators train` arguments the runner recorded for that run, passed to
   speculators.train.cli.main (plain on a GPU; with the runner's CPU adapter on a CPU).
Runner overrides after the options go to both runner runs (e.g. `hardware=gpu1`).
Throughput is training tokens over the time of the optimizer steps (speculators' own profile),
skipping the first 5 steps; wall time of each training call is printed too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def tokens_per_s(records: list[dict]) -> float:
    steps = [r for r in records if "profile/step_ms" in r][5:]
    tokens = sum(r["profile/tokens_per_s"] * r["profile/step_ms"] / 1000 for r in steps)
    return tokens / (sum(r["profile/step_ms"] for r in steps) / 1000)


def direct(argv: list[str]) -> list[dict]:
    """speculators' own trainer on `argv`: plain on a GPU (with the one fix torch 2.11 needs to
    run its fused loss at all), through the runner's adapter on a CPU (it cannot run there
    otherwise)."""
    import torch
    from speculators.train.cli import main as speculators_train
    from speculators.train.config import TrainConfig

    from runner.integrations.speculators import (
        TrainingState,
        fix_fused_loss_for_torch_compile,
        runner_training,
    )
    from runner.integrations.speculators_metrics import capture_metrics

    with capture_metrics() as capture:
        if torch.cuda.is_available():
            fix_fused_loss_for_torch_compile()
            speculators_train(TrainConfig.resolve(argv))
        else:
            with runner_training(TrainingState()):
                speculators_train(TrainConfig.resolve(argv))
    return capture.records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--direct", default=None, help=argparse.SUPPRESS)  # internal: one direct run
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*", help="runner overrides for both runner runs")
    args = ap.parse_args()
    if args.direct:
        spec = Path(args.direct)
        t0 = time.time()
        records = direct(json.loads((spec / "argv.json").read_text()))
        (spec / "result.json").write_text(
            json.dumps({"records": records, "seconds": time.time() - t0})
        )
        return
    over = [
        "run.stages=[train]",
        "run.force=[train]",
        f"train.max_steps={args.steps}",
        "train.epochs=1",
        *args.overrides,
    ]
    runs: dict[str, list[float]] = {"runner": [], "direct": []}
    walls: dict[str, list[float]] = {"runner": [], "direct": []}
    # Alternate runner, direct, runner, direct: the order of runs must not decide the ratio.
    for _ in range(args.rounds):
        t0 = time.time()
        out = subprocess.run(
            [sys.executable, "-m", "runner", *over], capture_output=True, text=True
        )
        if out.returncode:
            sys.exit(out.stdout[-2000:] + out.stderr[-2000:])
        line = next(x for x in out.stdout.splitlines() if x.strip().startswith("train "))
        art = Path(line.split()[-1])
        manifest = json.loads((art / "manifest.json").read_text())
        runs["runner"].append(
            tokens_per_s([json.loads(x) for x in (art / "metrics.jsonl").read_text().splitlines()])
        )
        walls["runner"].append(manifest["seconds"])
        # The recorded command, without the MLflow logger; argv[:2] is "speculators train".
        argv = [a for a in manifest["speculators_command"][2:] if a not in ("--logger", "mlflow")]
        argv[argv.index("--save-path") + 1] = tempfile.mkdtemp(prefix="direct_")
        # In a fresh process too, like the runner: no threads or caches carried between the two.
        spec = Path(tempfile.mkdtemp(prefix="direct_io_"))
        (spec / "argv.json").write_text(json.dumps(argv))
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.train_bench", "--direct", str(spec)],
            capture_output=True,
            text=True,
        )
        if out.returncode:
            sys.exit(out.stdout[-2000:] + out.stderr[-2000:])
        result = json.loads((spec / "result.json").read_text())
        runs["direct"].append(tokens_per_s(result["records"]))
        walls["direct"].append(result["seconds"])
    r, d = statistics.mean(runs["runner"]), statistics.mean(runs["direct"])
    res = {
        "steps": args.steps,
        "rounds": args.rounds,
        "runner_tok_s": runs["runner"],
        "direct_tok_s": runs["direct"],
        "ratio": r / d,
        "runner_train_stage_s": walls["runner"],
        "direct_call_s": walls["direct"],
        "wall_ratio": statistics.mean(walls["direct"]) / statistics.mean(walls["runner"]),
    }
    print(
        f"training {args.steps} steps x {args.rounds} rounds: runner {r:,.0f} tok/s, "
        f"speculators directly {d:,.0f} tok/s, "
        f"ratio {r / d:.3f}"
    )
    print(
        f"  per round runner {[round(x) for x in runs['runner']]}, "
        f"direct {[round(x) for x in runs['direct']]}"
    )
    print(
        f"  train stage {statistics.mean(walls['runner']):.1f} s vs direct call "
        f"{statistics.mean(walls['direct']):.1f} s "
        f"(throughput ratio by wall time {res['wall_ratio']:.3f})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
