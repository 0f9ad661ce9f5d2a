"""The project speaks of itself and its users' machines: no tracked file outside dev/ tells the
story of its own making (how its work was divided and the machines it was developed on).
Figures carry a date, a commit and the hardware;
history goes to CHANGELOG.md. The phrasings kept out are listed in dev/lab_talk.json, with
examples each pattern must catch: maintainers' words, kept with the maintainers' tooling.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIST = REPO / "dev" / "lab_talk.json"
WORDS: dict[str, str] = json.loads(LIST.read_text())["patterns"]


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
    return [REPO / f for f in out if not f.startswith("dev/")]


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
    nothing), and not the product's own words."""
    examples = json.loads(LIST.read_text())
    patterns = [re.compile(rx, re.IGNORECASE) for rx in WORDS.values()]
    missed = [s for s in examples["caught"] if not any(p.search(s) for p in patterns)]
    assert not missed, missed
    wrong = [s for s in examples["not_caught"] if any(p.search(s) for p in patterns)]
    assert not wrong, wrong
