"""What a user's console shows (runner/engine/console.py, conf/hydra/job_logging/runner.yaml): the
runner's own lines in one format, the plan and the summary; the libraries' lines in the job's
log file, their warnings counted in the summary. Run as a user runs it, through the CLI."""

from __future__ import annotations

import re
import sys
from collections import Counter

from tests.conftest import run_runner, tiny_overrides

# The console of a tiny pipeline (prepare to train), progress bars aside: measured 43 lines (the
# plan's 22, the summary's 10, the runner's log 10), then 3 more plan lines (the number format,
# this machine's speed, the estimate); a library that starts printing fails this.
MAX_LINES = 49
BARS = ("prepare:", "extract:", "Counting token frequencies:")
RUNNER_LINE = re.compile(r"^\d\d:\d\d:\d\d (INFO|WARNING|ERROR) ")


def _source(line: str) -> str:
    if RUNNER_LINE.match(line):
        return "runner log"
    if line.startswith(("  ", "====")) or not line.strip():
        return "plan and summary"
    return "other"


def test_the_console_holds_the_runners_lines_and_counts_the_libraries(
    tiny_model_dir, chats_jsonl, tmp_path
):
    over = tiny_overrides(
        tiny_model_dir, chats_jsonl, tmp_path / "out", "model.capture_layers=[1,2,3]"
    )
    proc = run_runner([sys.executable, "-m", "runner", *over], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # A progress bar redraws its line with \r: one line on the screen and in a log file.
    text = (proc.stdout + proc.stderr).rstrip("\n")
    lines = [line.split("\r")[-1] for line in text.split("\n")]
    by_source = Counter(_source(line) for line in lines)
    print(f"console: {len(lines)} lines, {dict(by_source)}")
    # Only the stages' progress bars are neither the runner's format nor plan or summary (the
    # vocab stage's is drawn by speculators' counting, which it calls).
    others = [line for line in lines if _source(line) == "other" and not line.startswith(BARS)]
    assert not others, "\n".join(others[:20])
    assert sum(not line.startswith(BARS) for line in lines) <= MAX_LINES, "\n".join(lines)
    assert any("[train] computed" in line for line in lines)
    # The summary's last line is the next thing to do (this run evaluated nothing: its table).
    last = proc.stdout.rstrip().splitlines()[-1].strip()
    assert last.startswith("next: eagle3-runner report "), last
    # The libraries' warnings (speculators' fallbacks, torch's pin_memory) are counted, and the
    # job's log file, named in the summary, holds them.
    note = next(line for line in lines if "library warnings not shown:" in line)
    log_file = note.rsplit(" in ", 1)[1].strip()
    with open(log_file) as fh:
        text = fh.read()
    assert "WARNING [py.warnings]" in text or "WARNING [speculators" in text, text[-2000:]
    assert not any("UserWarning" in line for line in lines)
