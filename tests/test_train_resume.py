"""Training that is interrupted resumes, and training on several ranks goes through torchrun:
on the tiny model, with `python -m runner` in a child process as a user runs it.

- SIGTERM (in process) stops at a step boundary with a checkpoint: the run exits 1, publishes
  nothing, prints the command that resumes; that command resumes and redoes no step.
- kill -9 in the middle of an epoch: the rerun resumes from the last checkpoint within the
  epoch (train.checkpoint_every) and redoes the steps after it.
- Two CPU ranks (torchrun, gloo): rank 0 logs into the runner's MLflow run; SIGTERM reaches
  every rank, which checkpoint and stop; the rerun finishes.
Tolerance against an uninterrupted run, stated: speculators keeps checkpoints in bf16 while it
trains in fp32, so a resumed run drifts slightly: per tensor, relative L2 difference of the
published draft <= 3%, final and validation loss within 1%, same step count.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, run_runner, run_until, runner_env, start_runner, tiny_overrides

DRIFT = 0.03
LOSS_RTOL = 0.01


def _command(model_dir, chats, root, *extra):
    base = tiny_overrides(
        model_dir,
        chats,
        root,
        "model.capture_layers=[0,2,3]",
        "train.max_steps=null",
        "train.epochs=3",
        "train.checkpoint_every=0.25",
        "train.echo_steps=true",
        *extra,
    )
    return [sys.executable, "-m", "runner", *base]


def train_result(root: Path) -> tuple[dict, dict]:
    (art,) = [p for p in (root / "store" / "train").iterdir() if not p.name.startswith(".")]
    metrics = json.loads((art / "manifest.json").read_text())["metrics"]
    return metrics, load_file(str(art / "draft" / "model.safetensors"))


def assert_close_drafts(resumed: tuple[dict, dict], reference: tuple[dict, dict]) -> None:
    (m, w), (m0, w0) = resumed, reference
    assert m["steps"] == m0["steps"]
    assert m["final_loss"] == pytest.approx(m0["final_loss"], rel=LOSS_RTOL)
    assert m["val_loss_epoch"] == pytest.approx(m0["val_loss_epoch"], rel=LOSS_RTOL)
    for k, ref in w0.items():
        diff = (w[k].float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)
        assert diff <= DRIFT, (k, float(diff))


@pytest.fixture(scope="module")
def reference(tiny_model_dir, chats_jsonl, tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    proc = run_runner(_command(tiny_model_dir, chats_jsonl, root))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return train_result(root)


def test_sigterm_checkpoints_stops_and_the_printed_command_resumes(
    reference, tiny_model_dir, chats_jsonl, tmp_path
):
    cmd = _command(tiny_model_dir, chats_jsonl, tmp_path)
    code, out = run_until(cmd, "'global_step': 40", signal.SIGTERM, answer="stopping after")
    assert code == 143, out[-3000:]  # 128 + SIGTERM, as shells and schedulers expect
    # Heard at once, not when the step ends (31 s in one case): the user is not left guessing.
    heard = float(out.split("(answered in ")[1].split(" s)")[0])
    assert heard < 1.0, heard
    assert "interrupted by SIGTERM during stage 'train'" in out
    assert "training was stopped by SIGTERM" in out and "saved a checkpoint" in out
    assert "Nothing was published" in out
    import mlflow

    runs = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_runs(
        mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
        .get_experiment_by_name("eagle3")
        .experiment_id
    )
    assert [r.info.status for r in runs] == ["KILLED"]
    resume = out.split("resumes from its latest checkpoint: ")[1].splitlines()[0]
    assert resume.startswith("python -m runner ") and "train.checkpoint_every=0.25" in resume
    train_store = tmp_path / "store" / "train"  # nothing published, no empty folder either
    assert not train_store.exists() or not list(train_store.iterdir())
    # The printed command, as printed (it is a shell command line).
    proc = subprocess.run(
        resume.replace("python", sys.executable, 1),
        shell=True,
        cwd=REPO,
        env=runner_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[train] resuming from" in proc.stdout  # the runner says so on the console ...
    # ... and speculators' own account, mid-epoch, is in the job's log file
    job_logs = sorted((tmp_path / "hydra").glob("*/runner.log"))
    assert "Resuming mid-epoch" in job_logs[-1].read_text()
    metrics, weights = train_result(tmp_path)
    assert (metrics["resumes"], metrics["steps_redone"]) == (1, 0)
    assert_close_drafts((metrics, weights), reference)


def test_kill_9_mid_epoch_resumes_from_the_last_checkpoint(
    reference, tiny_model_dir, chats_jsonl, tmp_path
):
    cmd = _command(tiny_model_dir, chats_jsonl, tmp_path)
    # Epoch 1's first in-epoch checkpoint is saved at its step 9 (of 35); kill a few steps later.
    code, _ = run_until(cmd, "'global_step': 48", signal.SIGKILL)
    assert code == -signal.SIGKILL
    proc = run_runner(cmd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics, weights = train_result(tmp_path)
    assert metrics["resumes"] == 1 and 1 <= metrics["steps_redone"] <= 9
    assert_close_drafts((metrics, weights), reference)


def test_two_cpu_ranks_through_torchrun_stop_together_and_resume(
    tiny_model_dir, chats_jsonl, tmp_path
):
    cmd = _command(tiny_model_dir, chats_jsonl, tmp_path, "train.cpu_processes=2")
    code, out = run_until(cmd, "'global_step': 20", signal.SIGTERM)
    assert code == 143, out[-3000:]
    assert "asking the ranks to checkpoint and stop" in out and "stopped by SIGTERM" in out
    assert "torch.distributed.run" in out and "--nproc_per_node=2" in out
    leftover = subprocess.run(
        ["pgrep", "-f", f"speculators_worker {tmp_path}"], capture_output=True, text=True
    )
    assert leftover.stdout.strip() == "", "a rank outlived the runner"
    proc = run_runner(cmd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics, _ = train_result(tmp_path)
    assert metrics["ranks"] == 2 and metrics["resumes"] == 1 and metrics["steps_redone"] == 0
    # Rank 0's speculators logger wrote into the runner's MLflow run, every step once.
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (last,) = client.search_runs(
        [client.get_experiment_by_name("eagle3").experiment_id],
        filter_string="attributes.status = 'FINISHED'",
    )
    history = client.get_metric_history(last.info.run_id, "train/loss")
    assert len({m.step for m in history}) == len(history) > 0
    arts = {a.path for a in client.list_artifacts(last.info.run_id, "train/logs")}
    assert arts == {"train/logs/train.log"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_loss_compiles_on_torch_2_11():
    from runner.integrations.speculators import fix_fused_loss_for_torch_compile

    applied = fix_fused_loss_for_torch_compile()
    assert applied == torch.__version__.startswith("2.11")


def _descendants(pid: int) -> list[int]:
    from runner.processes.process import children

    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children(p))
    return out


def _progress(root: Path) -> int:
    for f in root.glob("scratch/train-*/progress.json"):
        try:
            return int(json.loads(f.read_text()).get("global_step", 0))
        except (OSError, ValueError):
            pass
    return 0


def test_two_nodes_train_as_one_job_and_resume_after_one_node_is_killed(
    tiny_model_dir, chats_jsonl, tmp_path
):
    """hardware.num_nodes=2 on 127.0.0.1: two runner processes, node 0 runs the pipeline and
    node 1 joins its training through the c10d rendezvous (one gloo rank each). Node 1 killed
    with everything it started (kill -9, as a node dies): node 0's training fails and publishes
    nothing; the same two commands again resume from the last checkpoint and finish."""
    import contextlib
    import os
    import time

    from runner.serving.vllm_server import free_port

    common = [
        "hardware.num_nodes=2",
        f"hardware.rdzv_endpoint=127.0.0.1:{free_port()}",
        "train.epochs=2",  # of about 18 steps each on two ranks
    ]

    def node(rank: int) -> subprocess.Popen:
        cmd = _command(tiny_model_dir, chats_jsonl, tmp_path, *common, f"hardware.node_rank={rank}")
        return start_runner(cmd, new_session=True)

    follower, leader = node(1), node(0)
    deadline = time.time() + 600
    while _progress(tmp_path) < 20:
        assert time.time() < deadline and leader.poll() is None, leader.communicate()[0][-3000:]
        time.sleep(0.2)
    for pid in _descendants(follower.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    follower.wait()
    out = leader.communicate(timeout=300)[0]
    assert leader.returncode == 1, out[-3000:]
    assert "on 2 nodes failed" in out and "resumes from its latest checkpoint" in out, out[-3000:]
    assert "--nnodes=2" in out and "--rdzv_backend=c10d" in out
    assert not (tmp_path / "store" / "train").exists() or not list(
        (tmp_path / "store" / "train").iterdir()
    )
    follower, leader = node(1), node(0)
    out = leader.communicate(timeout=600)[0]
    assert leader.returncode == 0, out[-3000:]
    follower_out = follower.communicate(timeout=120)[0]
    assert follower.returncode == 0, follower_out[-3000:]
    assert "joining attempt 2" in follower_out
    metrics, _ = train_result(tmp_path)
    # Resumed from a checkpoint (the steps redone are 0 when node 1 died right after one, which
    # a loaded machine makes likely: both nodes finish the step they are in first).
    assert metrics["ranks"] == 2 and metrics["resumes"] == 1 and metrics["steps_redone"] >= 0
    assert "[train] resuming from" in out, out[-3000:]
