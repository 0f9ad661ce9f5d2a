"""A trained draft published as a hub-ready folder travels: speculators' own loader reads it
from another path, and its model card says what a user needs to serve it."""

from __future__ import annotations

import json
import shutil
import stat

import pytest

from runner.job import run_job
from runner.publish import main as publish
from tests.conftest import compose, tiny_overrides


@pytest.fixture(scope="module")
def trained(tiny_model_dir, chats_jsonl, tmp_path_factory):
    root = tmp_path_factory.mktemp("publish_out")
    run_job(compose(tiny_overrides(tiny_model_dir, chats_jsonl, root,
                                   "model.capture_layers=[1,2,3]")))  # fmt: skip
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
