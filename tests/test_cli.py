"""The `eagle3-runner` command family (runner/commands/cli.py, runner/commands/ls.py): subcommands,
`--version`,
discovery of groups, sweeps and keys, and bash completion, called in process. The console
scripts themselves (editable install and wheel) are run in tests/test_packaging.py."""

from __future__ import annotations

import os

import pytest

from runner.commands import cli, ls


def _dispatch(capsys, *argv: str) -> tuple[int, str, str]:
    ran = []
    with pytest.raises(SystemExit) as stop:
        cli.dispatch(lambda: ran.append(True) or None, list(argv))
    assert not ran, "a subcommand must not start the pipeline"
    out = capsys.readouterr()
    return stop.value.code, out.out, out.err


def test_version_names_the_runner_and_the_engines_that_shape_its_outputs(capsys):
    code, out, _ = _dispatch(capsys, "--version")
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("eagle3-runner 0.")
    named = {line.split()[0] for line in lines[1:]}
    assert {"vllm", "speculators", "torch", "transformers"} <= named
    assert "Hydra" not in out  # Hydra's own --version used to answer


def test_anything_but_a_subcommand_goes_to_the_pipeline():
    ran = []
    cli.dispatch(lambda: ran.append(True), ["model=hf", "run.plan_only=true"])
    assert ran == [True]


def test_ls_lists_every_group_option_with_the_default_marked_and_the_sweeps(capsys):
    code, out, _ = _dispatch(capsys, "ls")
    assert code == 0
    for group, options in ls.groups().items():
        for f in options:
            assert f.stem in out, (group, f.stem)
    lines = {line.split("*")[-1].split()[0] for line in out.splitlines() if "*" in line}
    assert {"smollm2_135m", "cpu", "transformers", "eagle3_small"} <= lines
    assert "capture_x_vocab" in out and "eagle3-runner -m -cn NAME" in out
    # One line a choice: the descriptions are the headers' first sentences, not whole headers.
    assert "One CUDA GPU (e.g. an H100/H200" in out


def test_ls_of_a_key_gives_its_type_value_origin_and_comment(capsys):
    code, out, _ = _dispatch(capsys, "ls", "vocab.draft_vocab_size", "hardware=gpu1")
    assert code == 0
    assert "type:    int" in out and "value:   32000" in out
    assert "set in:  conf/vocab/gpu.yaml" in out
    assert "most frequent in assistant turns" in out  # the schema's comment
    code, out, _ = _dispatch(capsys, "ls", "extract.storage")
    assert code == 0 and "one of bf16, fp8" in out


def test_ls_of_an_unknown_key_names_the_keys_its_section_takes(capsys):
    code, _, err = _dispatch(capsys, "ls", "train.lrr")
    assert code == 2 and "no key 'lrr' in train" in err and "lr, optimizer" in err
    code, _, err = _dispatch(capsys, "ls", "modell")
    assert code == 2 and "neither a config group" in err and "model" in err


def test_ls_of_a_group_prints_each_options_whole_header(capsys):
    code, out, _ = _dispatch(capsys, "ls", "hardware")
    assert code == 0 and "cpu (default)" in out
    assert "NO NVLink" in out  # deep in blackwell8's header, which `ls` alone cuts


def test_completion_offers_the_subcommands_and_hydras_overrides(capsys, monkeypatch):
    monkeypatch.setenv("COMP_LINE", "eagle3-runner p")
    cli._complete_subcommands()
    assert capsys.readouterr().out.split() == ["publish"]
    monkeypatch.setenv("COMP_LINE", "eagle3-runner publish --r")
    with pytest.raises(SystemExit):  # after a subcommand Hydra's overrides would be wrong
        cli._complete_subcommands()
    assert capsys.readouterr().out == ""


def test_the_companions_share_one_flag_vocabulary():
    from contextlib import redirect_stdout
    from io import StringIO

    from runner.commands import gc, publish, report
    from runner.tracking import ui

    flags = {}
    for name, mod in (("gc", gc), ("publish", publish), ("report", report), ("ui", ui)):
        buf = StringIO()
        with redirect_stdout(buf), pytest.raises(SystemExit):
            mod.main(["--help"])
        flags[name] = buf.getvalue()
        assert buf.getvalue().startswith(f"usage: eagle3-runner {name}")
    assert all("--output-root" in text for text in flags.values())
    assert "--run" in flags["publish"] and "--run" in flags["report"]


def test_the_companions_answer_a_bad_argument_with_one_line_and_exit_2(tmp_path, capsys):
    """An argument that names nothing usable (a hub id the hub refuses, a root with no store, a
    run the store does not hold) is one line and exit 2, the config-error status."""
    import mlflow

    from runner.commands import publish, report

    with pytest.raises(SystemExit) as bad:
        publish.main([str(tmp_path / "out"), "--repo-id", "not a/valid//id"])
    assert bad.value.code == 2 and "--repo-id" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert report.main(["--output-root", str(empty)]) == 2
    assert publish.main([str(tmp_path / "out"), "--output-root", str(empty)]) == 2
    assert capsys.readouterr().err.count("no MLflow store") == 2
    mlflow.MlflowClient(f"sqlite:///{empty / 'mlflow.db'}").create_experiment("eagle3")
    assert report.main(["--output-root", str(empty), "--run", "0123abcd"]) == 2
    assert "report: no run 0123abcd in sqlite" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_sweeps_are_found_from_any_folder(tmp_path):
    """`-cn <sweep>` from a folder outside the source tree: the sweeps that `ls` lists are on
    Hydra's search path there too (an editable install hid the plugin from Hydra's scan)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a user's shell has it
    out = subprocess.run(
        [sys.executable, "-m", "runner", "-cn", "draft_vocab_size", "--info", "searchpath"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "eagle3-runner-sweeps" in out.stdout and "/sweeps" in out.stdout


def test_ls_of_a_key_the_schema_leaves_bare_quotes_the_file_that_sets_it(capsys):
    code, out, _ = _dispatch(capsys, "ls", "train.lr", "hardware=gpu1")
    assert code == 0 and "set in:  conf/train/eagle3_gpu.yaml" in out
    assert "speculators' default" in out  # the comment on its line there


def test_cp_copies_a_preset_to_edit_and_says_how_to_use_it(tmp_path, capsys):
    """`eagle3-runner cp train/eagle3_gpu DIR/train/long.yaml`: the shipped file copied, and the
    printed command composes the edited copy (torchtune's `tune cp`)."""
    import subprocess
    import sys

    from runner.commands import cp

    dest = tmp_path / "mine" / "train" / "long.yaml"
    assert cp.main(["train/eagle3_gpu", str(dest)]) == 0
    said = capsys.readouterr().out
    assert f"--config-dir {tmp_path / 'mine'} train=long" in said
    dest.write_text(dest.read_text().replace("epochs: 10", "epochs: 7"))
    out = subprocess.run(
        [sys.executable, "-m", "runner", *said.split("eagle3-runner ")[1].split(), "--cfg", "job"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "  epochs: 7" in out.stdout, out.stderr[-2000:]
    assert cp.main(["sweeps/capture_layers", str(tmp_path / "s.yaml")]) == 0
    assert "-m --config-dir" in capsys.readouterr().out
    for bad in (["train/nope", str(tmp_path / "x.yaml")], ["train/eagle3_gpu", str(dest)]):
        with pytest.raises(SystemExit) as refused:
            cp.main(bad)
        assert refused.value.code == 2


def test_output_cut_short_by_a_reader_ends_quietly(tmp_path):
    """`eagle3-runner --help | head -1`: the reader leaving is not an error (no traceback, no
    "config error"), exit 0."""
    import subprocess
    import sys

    from tests.conftest import REPO

    cmd = f"{sys.executable} -m runner --help | head -1"
    proc = subprocess.run(
        ["bash", "-o", "pipefail", "-c", cmd],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("eagle3-runner:") and proc.stderr == ""


def test_a_draft_trained_elsewhere_is_evaluated_alone(tmp_path):
    """eval.draft with no run.stages: evaluate alone (a draft trained here would be ignored);
    stages named explicitly are kept."""
    from runner.core.schema import typed
    from tests.conftest import compose

    draft = tmp_path / "draft"
    assert typed(compose([f"eval.draft={draft}"])).run.stages == ["evaluate"]
    both = typed(compose([f"eval.draft={draft}", "run.stages=[prepare,evaluate]"]))
    assert both.run.stages == ["prepare", "evaluate"]
    assert typed(compose([])).run.stages == ["all"]


def test_gc_with_nothing_to_remove_says_so(tmp_path, capsys):
    from runner.commands.gc import main as gc

    (tmp_path / "store").mkdir()
    assert gc(["--output-root", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip().endswith("nothing to remove")
