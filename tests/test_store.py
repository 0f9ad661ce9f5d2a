"""The artifact store: keys that move with what changes the output, atomic publishing."""

from __future__ import annotations

import json

import pytest

from runner.store import MANIFEST, ArtifactStore, compute_key


def test_key_depends_on_config_upstream_and_versions():
    base = compute_key("train", "1", {"lr": 1e-3}, {"extract": "a"}, {"speculators": "0.9.0"})
    assert base == compute_key(
        "train", "1", {"lr": 1e-3}, {"extract": "a"}, {"speculators": "0.9.0"}
    )
    assert base != compute_key(
        "train", "1", {"lr": 2e-3}, {"extract": "a"}, {"speculators": "0.9.0"}
    )
    assert base != compute_key(
        "train", "1", {"lr": 1e-3}, {"extract": "b"}, {"speculators": "0.9.0"}
    )
    assert base != compute_key(
        "train", "1", {"lr": 1e-3}, {"extract": "a"}, {"speculators": "0.9.1"}
    )
    assert base != compute_key(
        "train", "2", {"lr": 1e-3}, {"extract": "a"}, {"speculators": "0.9.0"}
    )


def test_publish_is_atomic_and_records_files(tmp_path):
    store = ArtifactStore(tmp_path)
    manifest: dict = {"metrics": {"x": 1}}
    with store.writing("vocab", "k1", manifest) as out:
        (out / "d2t.npy").write_bytes(b"12345")
        assert store.get("vocab", "k1") is None  # not visible while being written
    art = store.get("vocab", "k1")
    assert art is not None
    m = json.loads((art.path / MANIFEST).read_text())
    assert m["files"] == [
        {
            "path": "d2t.npy",
            "bytes": 5,
            "sha256": "5994471abb01112afcc18159f6cc74b4f511b99806da59b3caf5a9c173cacfc5",
        }
    ]
    assert m["total_bytes"] == 5 and m["seconds"] >= 0


def test_an_interrupted_write_leaves_nothing(tmp_path):
    store = ArtifactStore(tmp_path)
    with pytest.raises(KeyboardInterrupt), store.writing("extract", "k2", {}) as out:
        (out / "hs_0.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt
    assert store.get("extract", "k2") is None
    assert not (tmp_path / "store").exists()  # not even an empty folder


def test_a_folder_without_manifest_is_not_trusted(tmp_path):
    store = ArtifactStore(tmp_path)
    (tmp_path / "store" / "train" / "k3").mkdir(parents=True)
    assert store.get("train", "k3") is None


def test_a_forced_rerun_replaces_the_artifact(tmp_path):
    store = ArtifactStore(tmp_path)
    for content in (b"old", b"new"):
        with store.writing("train", "k4", {}) as out:
            (out / "f").write_bytes(content)
    assert (store.get("train", "k4").path / "f").read_bytes() == b"new"
    assert sorted(p.name for p in (tmp_path / "store" / "train").iterdir()) == ["k4"]
