"""One training rank under torchrun: `torchrun --nproc_per_node N -m
runner.integrations.speculators_worker REQUEST.json`, started by stages/train/ through
runner/processes/launch.py.

REQUEST.json holds {"settings": speculators' train settings ({field: value}), "slots": [...],
"work": folder, "device": cpu|cuda, "env": {...}} (env: set before training, e.g. the MLflow
run). On several nodes every node's torchrun reads the same file (stages/train/nodes.py). Each rank
runs speculators' trainer through `runner.integrations.speculators.run_training` (CPU and gloo
adapters, stop at a step boundary with a resumable checkpoint); rank 0 writes the metric
records and outcome.json into the work folder, which the runner reads after torchrun exits. A
stop exits 0 (the outcome says "stopped"); anything else propagates and torchrun reports it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from runner.integrations.speculators import run_training


def main(request_file: str) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    request = json.loads(Path(request_file).read_text())
    # What the runner's environment gives rank 0 wherever it runs (on several nodes, rank 0 may
    # be on another node than the runner that wrote the request): the MLflow run to log into.
    os.environ.update(request.get("env") or {})
    run_training(
        dict(request["settings"]),
        tuple(request["slots"]),
        Path(request["work"]),
        device=request.get("device"),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
