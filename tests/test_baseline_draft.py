"""eval.baseline_draft, the draft to beat: found where the user says (a folder, a finished run
of this root, a hub id), refused in the plan when it cannot be served, and compared with the
run's draft prompt by prompt. (The e2e lane serves one against a trained draft.)"""

from __future__ import annotations

import pytest

from runner.core.schema import typed
from stages.evaluate import baseline
from tests.conftest import compose


def _cfg(tmp_path, value):
    return typed(compose([f"run.output_root={tmp_path}", f"eval.baseline_draft={value}"]))


def test_a_baseline_is_a_folder_a_run_of_this_root_or_a_hub_id(tmp_path, monkeypatch):
    folder = tmp_path / "draft"
    folder.mkdir()
    assert baseline.locate(_cfg(tmp_path, folder)) == (folder, "")
    assert "is not a folder" in baseline.locate(_cfg(tmp_path, tmp_path / "none"))[1]
    where, why = baseline.locate(_cfg(tmp_path, "run:0123456789abcdef"))
    assert where is None and "not in this output root's MLflow store" in why
    # A hub id not in the cache: fetched when the stage runs, refused at once offline.
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert baseline.locate(_cfg(tmp_path, "lightseekorg/kimi-k2.5-eagle3-mla")) == (None, "")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    where, why = baseline.locate(_cfg(tmp_path, "lightseekorg/kimi-k2.5-eagle3-mla"))
    assert where is None and "HF_HUB_OFFLINE" in why


def _prompts(pairs):
    return [{"accepted": a, "drafts": d} for a, d in pairs]


def test_two_drafts_on_the_same_prompts_get_a_paired_verdict():
    # 20 prompts: ours accepts 2 of 4 per step everywhere, theirs 1, or 2 give or take one.
    ours = {"mtbench": _prompts([(20, 10)] * 20)}
    worse = {"mtbench": _prompts([(10, 10)] * 20)}
    (row,) = baseline.compare(ours, worse)
    assert row["acceptance_length"] == 3.0 and row["baseline_acceptance_length"] == 2.0
    assert row["difference"] == pytest.approx(1.0) and row["verdict"] == "better"
    (row,) = baseline.compare(worse, ours)
    assert row["verdict"] == "worse" and row["difference_ci_high"] < 0
    noisy = {"mtbench": _prompts([(21, 10), (19, 10)] * 10)}
    (row,) = baseline.compare(ours, noisy)
    assert row["verdict"] == "within noise"
    assert row["difference_ci_low"] <= 0 <= row["difference_ci_high"]
    # A set the baseline did not serve, or served other prompts of, is not compared.
    assert baseline.compare(ours, {"humaneval": worse["mtbench"]}) == []


def test_the_plan_refuses_a_baseline_it_cannot_serve(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from runner.core.errors import ConfigError
    from runner.serving.vllm_server import free_port
    from tests.conftest import run_job

    empty = tmp_path / "empty"
    empty.mkdir()
    # A hub id not in the cache where the hub does not answer (no network): refused in the
    # plan, not when evaluate starts after training.
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    hub = "lightseekorg/kimi-k2.5-eagle3-mla"
    for value, why in (
        (empty, "holds no draft"),
        (tmp_path / "gone", "is not a folder"),
        (hub, "the hub does not answer for it"),
    ):
        with pytest.raises(ConfigError) as refused:
            run_job(
                compose(
                    [
                        f"run.output_root={tmp_path}",
                        "run.plan_only=true",
                        f"eval.baseline_draft={value}",
                    ]
                )
            )
        assert refused.value.key == "eval.baseline_draft" and why in refused.value.message


def test_a_finished_run_of_this_root_names_its_trained_draft(tmp_path):
    """run:<id>: the draft of a finished run of this output root's store (its path.train)."""
    import mlflow

    from runner.tracking.runs import tracking_uri

    client = mlflow.MlflowClient(tracking_uri(None, tmp_path))
    exp = client.create_experiment("eagle3")
    finished = client.create_run(exp)
    client.set_tag(finished.info.run_id, "path.train", str(tmp_path / "store/train/abc"))
    client.set_terminated(finished.info.run_id, "FINISHED")
    cfg = _cfg(tmp_path, f"run:{finished.info.run_id}")
    assert baseline.locate(cfg) == (tmp_path / "store/train/abc/draft", "")
    failed = client.create_run(exp)
    client.set_terminated(failed.info.run_id, "FAILED")
    where, why = baseline.locate(_cfg(tmp_path, f"run:{failed.info.run_id}"))
    assert where is None and "FAILED, not a finished run" in why
