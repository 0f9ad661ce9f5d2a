"""A user's own config files (`-cd`/`-cn`) are read before Hydra composes them: each YAML
mistake is one line naming the file and the line, exit 2, and a hostile file (nested aliases)
is refused in well under a second instead of stalling the runner."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from runner.core.config_files import check_config_dirs
from runner.core.errors import ConfigError
from tests.conftest import REPO

HEAD = "defaults:\n  - config\n  - _self_\n"


def _laughs(levels: int = 9) -> str:
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    prev = "a"
    for name in "bcdefghijk"[: levels - 1]:
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
        prev = name
    return HEAD + "\n".join(lines) + f"\nrun:\n  name: laughs\nbomb: *{prev}\n"


BAD = {
    "indent": (HEAD + "data:\n  num_samples: 10\n   max_seq_len: 3\n", ":6:", "mapping values"),
    "tab": (HEAD + "run:\n\tname: x\n", ":5:", "never tabs"),
    "quote": (HEAD + 'run:\n  name: "unclosed\n', ":6:", "quoted scalar"),
    "duplicate": (HEAD + "data:\n  num_samples: 1\n  num_samples: 2\n", ":6:", "duplicate key"),
    "python": (
        HEAD + 'run:\n  name: !!python/object/apply:os.system ["echo hi"]\n',
        ":5:",
        "no Python objects",
    ),
    "laughs": (_laughs(), "laughs.yaml", "aliases expand"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_config_file_is_named_with_its_line(tmp_path, name):
    text, where, words = BAD[name]
    (tmp_path / f"{name}.yaml").write_text(text)
    t0 = time.time()
    with pytest.raises(ConfigError) as refused:
        check_config_dirs(["-cd", str(tmp_path), "-cn", name, "run.plan_only=true"])
    assert time.time() - t0 < 2.0
    assert refused.value.key.startswith(str(tmp_path / f"{name}.yaml"))
    assert where in refused.value.key and words in refused.value.message, refused.value


def test_the_files_a_command_composes_are_read_and_no_others(tmp_path):
    """The primary config, a group option its defaults name and one given on the command line
    are read; a broken file of the directory that this command does not compose is not."""
    (tmp_path / "model").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "mine.yaml").write_text(HEAD.replace("  - _self_", "  - model: wide\n  - _self_"))
    (tmp_path / "model" / "wide.yaml").write_text("num_layers: 1\nnum_layers: 2\n")
    (tmp_path / "data" / "odd.yaml").write_text("source: [unclosed\n")
    (tmp_path / "unused.yaml").write_text("a:\n\tb: 1\n")
    with pytest.raises(ConfigError) as refused:
        check_config_dirs(["--config-dir", str(tmp_path), "--config-name=mine"])
    assert "model/wide.yaml:2:" in refused.value.key
    (tmp_path / "model" / "wide.yaml").write_text("num_layers: 2\n")
    check_config_dirs(["-cd", str(tmp_path), "-cn", "mine"])  # unused.yaml is not read
    with pytest.raises(ConfigError) as refused:
        check_config_dirs(["-cd", str(tmp_path), "-cn", "mine", "data=odd"])
    assert "data/odd.yaml:2:" in refused.value.key


def test_the_command_line_prints_one_line_and_exits_2(tmp_path):
    (tmp_path / "laughs.yaml").write_text(_laughs())
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "runner", "-cd", str(tmp_path), "-cn", "laughs"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"config error: {tmp_path / 'laughs.yaml'}: its YAML aliases expand")
    assert time.time() - t0 < 30


SEARCH = "defaults:\n  - search\n  - _self_\nhydra:\n  sweeper:\n    params:\n      train.lr: {}\n"


@pytest.mark.parametrize(
    ("space", "extra", "key", "words"),
    [
        ("tag(log, interval(3e-3, 2e-4))", [], "params.train.lr", "give the low end first"),
        ("choice()", [], "params.train.lr", "not a search range"),
        ("choice(1e-3, 2e-3)", ["hydra.sweeper.n_trials=0"], "n_trials", "whole number >= 1"),
        ("choice(1e-3, 2e-3)", ["hydra.sweeper.direction=maximise"], "direction", "maximize"),
    ],
)
def test_a_search_that_cannot_run_is_one_line_before_any_trial(tmp_path, space, extra, key, words):
    (tmp_path / "mine.yaml").write_text(SEARCH.format(space))
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "runner", "-m", "-cd", str(tmp_path), "-cn", "mine"),
            *extra,
            f"run.output_root={tmp_path / 'out'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"config error: hydra.sweeper.{key}: ") and words in line, line
    assert not (tmp_path / "out" / "mlflow.db").exists()  # no parent run, no trial
