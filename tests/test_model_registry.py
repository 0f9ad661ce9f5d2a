"""The served draft in MLflow's registry: a logged model of its run (the experiment's Models tab),
registered from its own `models:/` address, one version per distinct weights."""

from __future__ import annotations

import shutil

import mlflow

from runner.core.schema import TrackingConfig
from runner.tracking.runs import Tracker


def test_a_draft_is_a_logged_model_and_one_version_per_distinct_weights(tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text('{"architectures": ["Eagle3DraftModel"]}')
    (draft / "model.safetensors").write_bytes(b"\x01" * 64)
    root = tmp_path / "out"
    tracker = Tracker(TrackingConfig(), root)
    versions = []
    try:
        for run, folder in (("first", draft), ("same weights, another k", draft)):
            tracker.start(run, {})
            versions.append(tracker.register_draft("eagle3-tiny", folder, "a draft", {"k": "3"}))
            tracker.end()
        other = tmp_path / "retrained"
        shutil.copytree(draft, other)
        (other / "model.safetensors").write_bytes(b"\x02" * 64)
        tracker.start("retrained", {})
        versions.append(tracker.register_draft("eagle3-tiny", other, "a draft", {"k": "3"}))
        tracker.end()
    finally:
        mlflow.end_run()
    # A sweep over evaluation settings serves the same weights: it registers nothing new.
    assert versions == ["1", "1", "2"]
    client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    models = client.search_logged_models(experiment_ids=[tracker.experiment_id])
    assert len(models) == 2 and all(m.status == "READY" for m in models)
    for v in client.search_model_versions("name='eagle3-tiny'"):
        assert v.source.startswith("models:/") and v.tags["weights_sha256"]
        model_id = v.source.removeprefix("models:/")
        files = {a.path for a in client.list_logged_model_artifacts(model_id)}
        assert files == {"config.json", "model.safetensors"}
    # The model's files are in the output root's own store: a copied root carries them.
    assert all(str(root) in m.artifact_location for m in models)
