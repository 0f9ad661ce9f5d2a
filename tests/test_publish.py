"""A trained draft published as a hub-ready folder travels: speculators' own loader reads it
from another path, and its model card says what a user needs to serve it."""

from __future__ import annotations

import json
import shutil
import stat

import pytest

from runner.publish import main as publish
from tests.conftest import compose, run_job, tiny_overrides


@pytest.fixture(scope="module")
def trained(tiny_model_dir, chats_jsonl, tmp_path_factory):
    root = tmp_path_factory.mktemp("publish_out")
    run_job(
        compose(tiny_overrides(tiny_model_dir, chats_jsonl, root, "model.capture_layers=[1,2,3]"))
    )
    return root


def test_a_published_draft_loads_elsewhere_with_its_card(trained, tmp_path, tiny_model_dir):
    from speculators import SpeculatorModel

    out = tmp_path / "draft-for-hub"
    assert publish([str(out), "--output-root", str(trained), "--repo-id", "me/tiny-eagle3"]) == 0
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "README.md"} <= files
    assert all(p.stat().st_mode & stat.S_IROTH for p in out.iterdir()), "readable by all"
    card = (out / "README.md").read_text()
    assert card.startswith("---\nbase_model:")
    assert "[1, 2, 3, 4]: vllm (id k = input of decoder layer k" in card
    assert '"method": "eagle3", "model": "me/tiny-eagle3", "num_speculative_tokens": 3' in card
    assert "not evaluated" in card  # this run trained without evaluate
    # speculators' loader reads the folder from anywhere (the target: its recorded verifier).
    moved = shutil.copytree(out, tmp_path / "elsewhere" / "copy")
    model = SpeculatorModel.from_pretrained(str(moved))
    assert type(model).__name__ == "Eagle3DraftModel"
    conf = json.loads((moved / "config.json").read_text())
    assert conf["speculators_config"]["verifier"]["name_or_path"] == str(tiny_model_dir)
    # A second publish to the same non-empty folder is refused, leaving it as it was.
    assert publish([str(out), "--output-root", str(trained)]) == 1


def test_a_draft_travels_packed_without_the_targets_embeddings(trained, tmp_path, tiny_model_dir):
    """pack leaves out what the target already holds; unpack restores it byte for byte from the
    target, and refuses a target whose weights differ."""
    import torch
    from safetensors.torch import load_file, save_file

    from runner.transfer import main as transfer

    draft = next((trained / "store" / "train").glob("*/draft"))
    packed, back = tmp_path / "packed", tmp_path / "back"
    assert transfer(["pack", str(draft), str(packed), "--target", str(tiny_model_dir)]) == 0
    record = json.loads((packed / "packed.json").read_text())
    assert list(record["omitted"]) == ["embed_tokens.weight"]
    assert (packed / "model.safetensors").stat().st_size < (
        draft / "model.safetensors"
    ).stat().st_size
    assert transfer(["unpack", str(packed), str(back), "--target", str(tiny_model_dir)]) == 0
    a, b = load_file(str(draft / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (back / "config.json").read_text() == (draft / "config.json").read_text()
    # Another target (one embedding value changed): refused, nothing written.
    other = shutil.copytree(tiny_model_dir, tmp_path / "other_target")
    weights = load_file(str(other / "model.safetensors"))
    weights["model.embed_tokens.weight"][0, 0] += 1
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    assert transfer(["unpack", str(packed), str(tmp_path / "no"), "--target", str(other)]) == 1
    assert not (tmp_path / "no").exists()


def test_a_sweep_parent_publishes_its_best_child_by_the_objective(tmp_path):
    """The child with the highest value in its objective column is chosen; children that were
    not evaluated, failed or trained no draft are passed over."""
    import json

    import mlflow

    from runner.job_tags import COLUMNS_TAG, OBJECTIVE_TAG
    from runner.publish import best_child

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("eagle3", artifact_location=(tmp_path / "a").as_uri())

    def child(value, status="FINISHED", draft=True):
        tags = {OBJECTIVE_TAG: "acceptance_length"}
        if value is not None:
            tags[COLUMNS_TAG] = json.dumps({"acceptance_length": value, "train_loss": 1.0})
        if draft:
            tags["path.train"] = "/somewhere/train/key"
        run = client.create_run(exp, tags=tags)
        client.set_terminated(run.info.run_id, status=status)
        return client.get_run(run.info.run_id)

    runs = [child(1.21), child(1.34), child(1.9, status="FAILED"), child(2.0, draft=False)]
    runs.append(child(None))
    best, objective, value = best_child(runs)
    assert best.info.run_id == runs[1].info.run_id
    assert (objective, value) == ("acceptance_length", 1.34)
    assert best_child([runs[4]]) is None
