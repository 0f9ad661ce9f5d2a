"""Signposts that hold: every repository path (`runner/engine/rates.yaml`, `docs/install.md`,
...) and every `make` target named in the tracked text (code, comments, docs, YAML, the
Makefile) exists. A file moved or a target renamed without its mentions leaves readers at a
dead end; this names each one. CHANGELOG.md is history and may name what is gone; a name
written as a pattern (`conf/GROUP/OPTION.yaml`, `stages/<stage>/rates.yaml`) is not a path."""

from __future__ import annotations

import re
import subprocess

from tests.conftest import REPO

# The repository's own top-level folders: a path under one of them is a signpost to check.
ROOTS = (
    "runner",
    "stages",
    "conf",
    "sweeps",
    "tests",
    "docs",
    "scripts",
    "benchmarks",
    "dev",
    "constraints",
    ".ci",
)
PATH = re.compile(
    rf"(?<![\w./<-])((?:{'|'.join(re.escape(r) for r in ROOTS)})/[\w./<>-]*[\w>-]"
    r"\.(?:py|md|yaml|yml|sh|txt|toml|json))"
)
# `make X` in backquotes, or a command line that starts with it.
MAKE = re.compile(r"(?:`|^\s*(?:\$ )?)make ([a-z][\w-]*)", re.M)
TEXT = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt", ".cfg", ""}


def _pattern(ref: str) -> bool:
    """A name written as a pattern: a placeholder part (`<stage>`, `GROUP`, `NAME`)."""
    return "<" in ref or any(p.isupper() for p in re.split(r"[/.]", ref))


def dead_signposts() -> list[str]:
    files = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    targets = set(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))
    dead = []
    for name in files:
        path = REPO / name
        # CHANGELOG.md is history; this file names dead signposts on purpose (below).
        if name in ("CHANGELOG.md", "tests/test_signposts.py") or path.suffix not in TEXT:
            continue
        if not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            for m in PATH.finditer(line):
                ref = m.group(1)
                if not _pattern(ref) and not (REPO / ref).exists():
                    dead.append(f"{name}:{i}: {ref}")
            for m in MAKE.finditer(line):
                if m.group(1) not in targets:
                    dead.append(f"{name}:{i}: make {m.group(1)}")
    return dead


def test_every_path_and_make_target_named_in_the_repository_exists():
    assert dead_signposts() == []


def test_a_dead_signpost_is_caught_and_a_pattern_is_not():
    assert PATH.findall("see runner/engine/rates.yaml and docs/gone.md.") == [
        "runner/engine/rates.yaml",
        "docs/gone.md",
    ]
    assert _pattern("conf/GROUP/OPTION.yaml") and _pattern("stages/<stage>/rates.yaml")
    assert not _pattern("docs/gone.md")
    assert MAKE.findall("run `make test-fast`, then\n    make gpu-bundle\nto make sure") == [
        "test-fast",
        "gpu-bundle",
    ]
