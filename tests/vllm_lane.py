"""What the vLLM lane's two files (test_vllm_backend.py, test_vllm_small_runs.py) share: the
reduced run they start from, finding the vLLM servers a run left behind, and a runner child read
up to a line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

# The embedded default, reduced: 64 rows, one epoch, 16 MT-bench prompts of 32 new tokens. The
# lane compares drafts by the run's objective (MT-bench); HumanEval and the held-out set would
# add about 45 s to each of its evaluations, and the e2e lane evaluates all three. (160 rows and
# 40 prompts of 64 tokens took 826 s of the lane's shared run on an AVX2-only 2-core CPU, most
# of it extraction, training and generation in float32; 96 rows and 24 prompts of 48, 424 s.)
REDUCED = [
    "data.num_samples=64",
    "train.epochs=1",
    "eval.prompts=[mtbench]",
    "eval.num_prompts=16",
    "eval.max_new_tokens=32",
    "eval.compare_target=false",
    # One epoch of 64 to 160 rows serves at about 1.1 (the lane's drafts): a floor below that.
    "eval.acceptance_floor=1.01",
]


def servers_under(root: Path) -> list[int]:
    """vLLM servers still running whose command line names this lane's output root."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "vllm.entrypoints.openai.api_server" in cmd and str(root) in cmd:
            pids.append(int(proc.name))
    return pids


def runner_until(args: list[str], root: Path, started) -> subprocess.Popen:
    """`python -m runner <args>` in a child, read until a line satisfies `started`; a server
    must be up."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", *args, f"run.output_root={root}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if started(line):
            break
    assert servers_under(root), "".join(seen[-20:])
    return proc
