"""CPU training steps with the runner's kernels for speculators' argmax and KL loss
(runner/integrations/speculators_cpu.py) against speculators' own, measured in one run.

Usage: EAGLE3_RUNNER_HOME=<root with a finished default run> \
    python -m benchmarks.cpu_kernels_bench --steps 40 --rounds 2 [--key KEY] [--total-seq-len 1024]

Each arm is a fresh process that trains `--steps` steps of a train artifact's settings (`--key`,
else the root's newest: its prepared rows, hidden states and vocab) through the runner's CPU
adapter, with or without the kernels, the arms alternating. Printed: the median forward,
backward, optimizer and whole-step milliseconds of each arm (speculators' own profile, the first
5 steps skipped), and the ratio of the step times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

PARTS = ("fwd", "bwd", "opt", "step")


def train_manifest(root: Path, key: str | None) -> dict:
    manifests = sorted(
        (root / "store" / "train").glob(f"{key or '*'}/manifest.json"),
        key=lambda p: p.stat().st_mtime,
    )
    if not manifests:
        sys.exit(f"no train artifact under {root}/store/train: run the default pipeline first")
    return json.loads(manifests[-1].read_text())


def one_arm(kernels: bool, args: argparse.Namespace) -> None:
    import runner.integrations.speculators_cpu as cpu
    from runner.core.layout import default_root
    from runner.integrations.speculators import run_training

    if not kernels:
        cpu.cpu_kernels = nullcontext
    steps, total_seq_len, out = args.steps, args.total_seq_len, args.out
    manifest = train_manifest(Path(default_root()).resolve(), args.key)
    settings = dict(manifest["speculators_settings"])
    work = out.parent / f"work-{out.stem}"
    settings.update(
        save_path=str(work / "checkpoints"),
        log_dir=str(work / "logs"),
        max_steps=steps,
        epochs=1,
        log_freq=1,
        train_data_ratio=0.999,  # one row to validate: the steps are what is measured
    )
    settings.pop("logger", None)
    if total_seq_len:
        settings["total_seq_len"] = total_seq_len
    aux = manifest.get("config", {}).get("aux_layers", ())
    slots = tuple(manifest.get("slots") or range(len(aux) + 1))  # captures + the final layer
    run_training(settings, slots, work, device="cpu")
    records = [json.loads(line) for line in (work / "metrics.jsonl").open()]
    steps_seen = [r for r in records if "profile/step_ms" in r][5:]
    medians = {p: statistics.median(r[f"profile/{p}_ms"] for r in steps_seen) for p in PARTS}
    out.write_text(json.dumps(medians))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--total-seq-len", type=int, default=None)
    ap.add_argument("--key", default=None, help="the train artifact (default: the newest)")
    ap.add_argument("--arm", choices=["on", "off"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        one_arm(args.arm == "on", args)
        return
    results: dict[str, list[dict]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for arm in ("off", "on"):
                out = Path(tmp) / f"{arm}{r}.json"
                cmd = [sys.executable, "-m", "benchmarks.cpu_kernels_bench", "--arm", arm]
                cmd += ["--steps", str(args.steps), "--out", str(out)]
                if args.total_seq_len:
                    cmd += ["--total-seq-len", str(args.total_seq_len)]
                if args.key:
                    cmd += ["--key", args.key]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode:
                    sys.exit(f"the {arm} arm failed:\n{done.stderr[-3000:]}")
                results[arm].append(json.loads(out.read_text()))
    print(f"{'arm':<28}" + "".join(f"{p + ' ms':>10}" for p in PARTS))
    means = {}
    for arm, label in (("off", "speculators' kernels"), ("on", "the runner's CPU kernels")):
        means[arm] = {p: statistics.mean(x[p] for x in results[arm]) for p in PARTS}
        print(f"{label:<28}" + "".join(f"{means[arm][p]:>10.1f}" for p in PARTS))
    ratio = means["on"]["step"] / means["off"]["step"]
    print(f"step time ratio (runner's / speculators'): {ratio:.3f}")


if __name__ == "__main__":
    main()
