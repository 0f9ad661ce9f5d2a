"""What MLflow shows of a run as the runner records it: the experiment's primary metric (the
compare view's), and figures narrow enough for the run page's description."""

from __future__ import annotations

import mlflow

from runner.core.schema import TrackingConfig
from runner.tracking.runs import Tracker


def test_the_experiments_primary_metric_is_the_objective_unless_it_has_one(tmp_path):
    """MLflow's compare view opens on the experiment's primary metric: the runner names its
    objective there, once, and leaves a primary metric the user chose."""
    from runner.tracking.runs import PRIMARY_GREATER_TAG, PRIMARY_METRIC_TAG

    root = tmp_path / "out"
    first = Tracker(TrackingConfig(), root, "evaluate/acceptance_length")
    client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    tags = client.get_experiment(first.experiment_id).tags
    assert tags[PRIMARY_METRIC_TAG] == "evaluate/acceptance_length"
    assert tags[PRIMARY_GREATER_TAG] == "true"
    client.set_experiment_tag(first.experiment_id, PRIMARY_METRIC_TAG, "evaluate/mine")
    Tracker(TrackingConfig(), root, "evaluate/acceptance_length")
    assert client.get_experiment(first.experiment_id).tags[PRIMARY_METRIC_TAG] == "evaluate/mine"
    # A run without an objective (training alone) names none on a new experiment.
    other = Tracker(TrackingConfig(experiment="train-only"), root)
    assert PRIMARY_METRIC_TAG not in client.get_experiment(other.experiment_id).tags


def test_a_wide_figure_is_logged_at_most_720_pixels_wide(tmp_path):
    """The run's description shows its figures, each as wide as its pixels: a 10-inch figure
    (extraction's three panels) held the page's main column at 1,000 px."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    from runner.tracking.runs import FIGURE_MAX_PX

    tracker = Tracker(TrackingConfig(), tmp_path / "out")
    try:
        run_id = tracker.start("figures", {})
        wide, _ = plt.subplots(1, 3, figsize=(10, 3.2))
        narrow, _ = plt.subplots(figsize=(6, 3.5))
        tracker.log_figure(wide, "extract/layer_stats.png")
        tracker.log_figure(narrow, "train/loss_curves.png")
    finally:
        tracker.end()
        mlflow.end_run()
    client = mlflow.MlflowClient(tracker.uri)
    widths = {}
    for name in ("extract/layer_stats.png", "train/loss_curves.png"):
        with Image.open(client.download_artifacts(run_id, name, str(tmp_path))) as image:
            widths[name] = image.size[0]
    assert widths == {"extract/layer_stats.png": FIGURE_MAX_PX, "train/loss_curves.png": 600}
