"""The project speaks of itself and its users' machines: no tracked file outside dev/ tells the
story of its own making (numbered rounds of work, the machines it was developed on, what a call
to them carried, machines that went back). Figures carry a date, a commit and the hardware;
history goes to CHANGELOG.md. dev/ holds the maintainers' tooling and may speak of its runner.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    r"thirteenth|\d+(?:st|nd|rd|th)"
)
# Each pattern names what it keeps out. Case does not matter.
WORDS = {
    "the development environment": r"\bworkplace\b|\bdevice time\b|\bdevice call\b",
    "work sessions": rf"\b(?:(?:{ORDINALS})(?: H200| GPU)? session|(?:H200|GPU) sessions?)\b",
    "rounds of work": rf"\b(?:(?:{ORDINALS}|forty-\w+|thirty-\w+) stop\b(?! signal)|stop \d+\b)",
    "machines that went back": (
        r"\bmachines? (?:that )?(?:went|goes|go) back\b|\blost between calls\b"
    ),
    "what a call carried": r"\b(?:64|60) MiB (?:a|per) call\b|\bone (?:piece )?per call\b",
    "machines lent": r"\b(?:not |was |were |is )lent\b|\blent machine",
}
# This file names the words it keeps out.
SKIP = {"tests/test_no_lab_talk.py"}


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):  # not a checkout: every file below it
        out = [
            str(p.relative_to(REPO))
            for p in REPO.rglob("*")
            if p.is_file() and not {".git", ".venv"} & set(p.parts)
        ]
    return [REPO / f for f in out if not f.startswith("dev/") and f not in SKIP]


def test_no_file_outside_dev_speaks_of_how_the_project_was_made():
    found = []
    patterns = {what: re.compile(rx, re.IGNORECASE) for what, rx in WORDS.items()}
    for path in tracked_files():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for what, rx in patterns.items():
                if m := rx.search(line):
                    found.append(f"{path.relative_to(REPO)}:{n}: {what}: {m.group(0)!r}")
    assert not found, "lab talk outside dev/:\n" + "\n".join(found[:60])


def test_the_words_are_caught_where_they_stand():
    """The patterns catch the phrasings they are for (a pattern that matches nothing guards
    nothing)."""
    said = [
        "on this workplace's H200s",
        "the eleventh session's stage times",
        "in the fourth H200 session",
        "the CI run of the forty-third stop",
        "a machine goes back 30 s after a call",
        "pieces of 60 MiB a call",
        "when no GPU machine is lent",
    ]
    patterns = [re.compile(rx, re.IGNORECASE) for rx in WORDS.values()]
    assert all(any(p.search(s) for p in patterns) for s in said)
    fine = [
        "a test session fixture",
        "the request goes back on the queue",
        "the first stop signal",
    ]
    assert not any(p.search(s) for p in patterns for s in fine)
