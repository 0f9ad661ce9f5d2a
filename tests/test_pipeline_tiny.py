"""prepare -> extract -> vocab -> train on a tiny random Llama and a local JSONL file, through
`run_job` (what `python -m runner` calls): real outputs, caching, MLflow, atomic publishing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from runner.core.hardware_settings import DTYPE_BYTES
from runner.core.number_format import choose_dtype
from tests.conftest import compose, run_job, tiny_overrides

CAPTURE = "model.capture_layers=[0,2,3]"
# The format hardware.dtype=auto takes on the CPU running the tests; OTHER, the other one.
HERE = choose_dtype("cpu").dtype
OTHER = "bfloat16" if HERE == "float32" else "float32"


def tiny(model_dir, data, root, *extra):
    return tiny_overrides(model_dir, data, root, CAPTURE, *extra)


@pytest.fixture(scope="module")
def first_run(tiny_model_dir, chats_jsonl, tmp_path_factory):
    root = tmp_path_factory.mktemp("runner_out")
    cfg = compose(tiny(tiny_model_dir, chats_jsonl, root))
    return cfg, run_job(cfg), root


def test_hidden_states_equal_the_models_own(first_run, tiny_model_dir):
    import datasets
    from transformers import AutoModelForCausalLM

    _, result, _ = first_run
    rows = datasets.load_from_disk(str(result.results["prepare"].path / "dataset")).with_format(
        "torch"
    )
    hs_dir = result.results["extract"].path / "hidden_states"
    assert len(list(hs_dir.glob("hs_*.safetensors"))) == len(rows)
    dtype = getattr(torch, HERE)  # the states are stored in the format the run computed in
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).eval()
    for i in (0, len(rows) - 1):
        ids = rows[i]["input_ids"]
        f = load_file(str(hs_dir / f"hs_{i}.safetensors"))
        assert f["hidden_states"].dtype == dtype and f["token_ids"].dtype == torch.int64
        assert f["hidden_states"].shape == (len(ids), 4, 64)  # ids 0, 2, 3 and the final 4
        assert torch.equal(f["token_ids"], ids)
        with torch.inference_mode():
            out = model(input_ids=ids[None], output_hidden_states=True)
            # vLLM id k < n is transformers' hidden_states[k] (0 = embeddings).
            for slot, k in enumerate((0, 2, 3)):
                torch.testing.assert_close(
                    f["hidden_states"][:, slot], out.hidden_states[k][0], atol=2e-2, rtol=2e-2
                )
            # The final slot is before the norm: normed, it gives transformers' last (post-norm)
            # state,
            # and it is not that state itself.
            last = f["hidden_states"][:, 3]
            torch.testing.assert_close(
                model.model.norm(last[None])[0], out.hidden_states[4][0], atol=3e-2, rtol=3e-2
            )
            assert not torch.allclose(last, out.hidden_states[4][0], atol=1e-2)


# (first loss, final loss, validation loss) of the tiny run per format it computes in. bf16:
# the default recipe's Muon at lr 1e-3 (was AdamW 3e-3: 0.028105, 0.030931); float32 measured on
# an AMD EPYC (Zen 3, AVX2) on 2026-12-07, Muon's orthogonalisation in float32 too.
PINNED_LOSSES = {
    "bfloat16": (0.091892, 0.087302, 0.083375),
    "float32": (0.091866, 0.087318, 0.083394),
}


def test_numbers_on_the_tiny_model_at_seed_0_are_pinned(first_run):
    """Same data, target and seed give the same training, step for step. Measured on the 2-core
    CPU build (torch 2.13+cpu); tolerance 1e-3 relative. A change here means the data, the mask,
    the hidden states or speculators' training changed: say why in the commit, then re-pin."""
    _, result, _ = first_run
    prepare, vocab = result.results["prepare"].metrics, result.results["vocab"].metrics
    train = result.results["train"].metrics
    assert (prepare["rows"], prepare["tokens"]) == (40, 2399)
    assert vocab["coverage"] == 1.0 and vocab["distinct_assistant_tokens"] <= 512
    assert train["steps"] == 8
    first, final, val = PINNED_LOSSES[HERE]
    assert train["first_loss"] == pytest.approx(first, rel=1e-3)
    assert train["final_loss"] == pytest.approx(final, rel=1e-3)
    assert train["val_loss_epoch"] == pytest.approx(val, rel=1e-3)


def test_the_other_number_format_trains_and_exports_too(tiny_model_dir, chats_jsonl, tmp_path):
    """Whichever format this CPU chose, the other finishes as well, the export check included
    (it reloads the bf16 checkpoint onto the run's states): float32 on a CPU with native bf16,
    bf16 on one without. Its states and key are its own."""
    run = run_job(compose(tiny(tiny_model_dir, chats_jsonl, tmp_path, f"hardware.dtype={OTHER}")))
    assert run.stages == {s: "computed" for s in ("prepare", "extract", "vocab", "train")}
    f = load_file(str(run.results["extract"].path / "hidden_states" / "hs_0.safetensors"))
    assert f["hidden_states"].dtype == getattr(torch, OTHER)
    manifest = json.loads((run.results["train"].path / "manifest.json").read_text())
    assert manifest["export_check"]["problems"] == []
    assert any("reloaded draft" in line for line in manifest["export_check"]["lines"])
    assert run.results["train"].metrics["steps"] == 8


def test_layer_statistics_are_recorded(first_run):
    _, result, _ = first_run
    stats = json.loads((result.results["extract"].path / "layer_stats.json").read_text())
    assert set(stats) == {"layer_0", "layer_2", "layer_3", "layer_4"}
    for s in stats.values():
        assert (
            s["rms"] > 0
            and s["std"] > 0
            and s["max_abs"] >= s["rms"]
            and s["nonfinite_fraction"] == 0
        )


def test_vocab_mapping_matches_the_frequencies(first_run):
    _, result, _ = first_run
    v = result.results["vocab"].path
    freq = torch.load(v / "token_freq.pt", weights_only=True)
    d2t, t2d = np.load(v / "d2t.npy"), np.load(v / "t2d.npy")
    assert t2d.shape == (49152,) and t2d.dtype == bool and t2d.sum() == 512 == len(d2t)
    draft_ids = np.arange(512) + d2t
    assert np.all(np.diff(draft_ids) > 0)  # ascending target ids
    assert np.array_equal(np.flatnonzero(t2d), draft_ids)  # t2d marks exactly those ids
    # Every token the data supervises is in the draft vocab when it has fewer distinct tokens.
    assert len(freq) <= 512 and set(freq) <= set(draft_ids.tolist())
    assert json.loads((v / "coverage.json").read_text())["coverage"] == 1.0


def test_draft_checkpoint_is_speculators_format(first_run):
    _, result, _ = first_run
    draft = result.results["train"].path / "draft"
    conf = json.loads((draft / "config.json").read_text())
    assert conf["speculators_model_type"] == "eagle3"
    assert conf["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    # Where vLLM reads the count of layers its fc layer takes (runner/integrations/vllm.py).
    assert conf["transformer_layer_config"]["num_aux_hidden_states"] == 3
    assert conf["draft_vocab_size"] == 512
    assert conf["eagle3_runner"]["capture_ids"] == [0, 2, 3, 4]
    weights = load_file(str(draft / "model.safetensors"))
    assert weights["fc.weight"].shape == (64, 3 * 64)
    assert not any("optimizer" in p.name for p in draft.iterdir())


def test_mlflow_run_holds_params_metrics_and_artifacts(first_run):
    import mlflow

    _, result, _ = first_run
    client = mlflow.MlflowClient(result.tracking_uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["vocab.draft_vocab_size"] == "512"
    assert run.data.params["resolved.capture_ids_vllm"] == "[0, 2, 3, 4]"
    m = run.data.metrics
    assert m["prepare/rows"] > 0 and m["extract/tokens_per_s"] > 0 and m["vocab/coverage"] == 1.0
    assert "train/loss" in m  # written by speculators' own MLflow logger into our run
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 8
    assert run.data.tags["artifact.extract"] == result.results["extract"].key
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config", "manifests", "vocab", "draft"} <= arts
    # speculators' settings are params under "speculators.", not one-point metrics, and only
    # for the draft method trained; no metric repeats another.
    assert not any(k.startswith(("speculators", "draft.", "trainer.", "dflash")) for k in m)
    assert run.data.params["speculators.speculator_type"] == "eagle3"
    assert not any(
        k.startswith(("speculators.dflash", "speculators.peagle")) for k in run.data.params
    )
    assert not any(k.startswith(("train/final_", "train/val_")) for k in m)
    # Per-layer statistics as one figure, the summary as the run's description.
    assert "extract/layer_stats.png" in {
        a.path for a in client.list_artifacts(run.info.run_id, "extract")
    }
    note = run.data.tags["mlflow.note.content"]
    assert "draft checkpoint:" in note
    # ... followed by the run's figures as images MLflow serves (its page shows them at once).
    address = f"get-artifact?path=extract%2Flayer_stats.png&run_uuid={run.info.run_id}"
    image = f"![extract/layer_stats.png]({address})"
    assert image in note
    # Markdown that wraps on the page (no code block, whose longest line widened it past the
    # side panel), read back as the console's summary by report.
    from runner.tracking.runs import description_text

    assert "```" not in note and "draft checkpoint:" in description_text(note)
    assert all(line.endswith("`  ") for line in note.split("\n\n![")[0].splitlines() if line)
    # The training data is the run's dataset input, with the rows prepare kept.
    (found,) = run.inputs.dataset_inputs
    tags = {t.key: t.value for t in found.tags}
    assert tags["mlflow.data.context"] == "training" and tags["rows"] == str(int(m["prepare/rows"]))
    assert found.dataset.digest == result.results["prepare"].key[:36]
    # ... with content: its rows' sizes as the schema and profile the UI's dataset drawer shows.
    schema = json.loads(found.dataset.schema)["mlflow_colspec"]
    assert [c["name"] for c in schema] == ["tokens", "supervised_tokens"]
    assert json.loads(found.dataset.profile)["num_rows"] == int(m["prepare/rows"])
    # The UI opens the experiment in its model-training view, not the GenAI one.
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"


def test_second_run_reuses_every_stage(first_run, tiny_model_dir, chats_jsonl):
    _, first, root = first_run
    again = run_job(compose(tiny(tiny_model_dir, chats_jsonl, root)))
    assert again.stages == {s: "cached" for s in ("prepare", "extract", "vocab", "train")}
    assert {s: r.key for s, r in again.results.items()} == {
        s: r.key for s, r in first.results.items()
    }
    # The reused training's run holds the params speculators logged when it trained.
    import mlflow

    client = mlflow.MlflowClient(first.tracking_uri)
    params = [client.get_run(r.run_id).data.params for r in (first, again)]
    ours = [{k: v for k, v in p.items() if k.startswith("speculators.")} for p in params]
    assert ours[0] and ours[0] == ours[1]


def test_changing_a_training_setting_reruns_only_train(first_run, tiny_model_dir, chats_jsonl):
    _, first, root = first_run
    changed = run_job(compose(tiny(tiny_model_dir, chats_jsonl, root, "train.lr=5e-4")))
    assert changed.stages == {
        "prepare": "cached",
        "extract": "cached",
        "vocab": "cached",
        "train": "computed",
    }
    assert changed.results["train"].key != first.results["train"].key


def test_the_drafts_attention_is_trained_recorded_and_keyed(first_run, tiny_model_dir, chats_jsonl):
    """train.sliding_window / train.full_attention_layers reach speculators: the served draft's
    config says which layer attends how; the default (speculators' own window) keeps the keys
    made before the settings existed, another setting retrains."""
    _, first, root = first_run
    window = run_job(compose(tiny(tiny_model_dir, chats_jsonl, root, "train.sliding_window=8")))
    full = run_job(
        compose(tiny(tiny_model_dir, chats_jsonl, root, "train.full_attention_layers=[0]"))
    )
    keys = {first.results["train"].key, window.results["train"].key, full.results["train"].key}
    assert len(keys) == 3
    manifest = json.loads((first.results["train"].path / "manifest.json").read_text())
    assert "sliding_window" not in manifest["config"]
    layer = {}
    for name, run in (("default", first), ("window", window), ("full", full)):
        conf = json.loads((run.results["train"].path / "draft" / "config.json").read_text())
        layer[name] = conf["transformer_layer_config"]
    assert layer["default"]["layer_types"] == ["sliding_attention"]
    assert layer["default"]["sliding_window"] == 2048
    assert layer["window"]["layer_types"] == ["sliding_attention"]
    assert layer["window"]["sliding_window"] == 8
    assert layer["full"]["layer_types"] == ["full_attention"]


def test_every_epochs_draft_is_kept_when_asked(first_run, tiny_model_dir, chats_jsonl):
    _, _, root = first_run
    two = ("train.epochs=2", "train.max_steps=null")
    over = tiny(tiny_model_dir, chats_jsonl, root, *two, "train.keep_epoch_drafts=true")
    run = run_job(compose(over)).results["train"]
    # Off, the setting is not in the key: the runs made before it was added stay cached.
    plain = run_job(compose(tiny(tiny_model_dir, chats_jsonl, root, *two)))
    assert plain.stages["train"] == "computed" and plain.results["train"].key != run.key
    assert not (plain.results["train"].path / "epochs").exists()
    manifest = json.loads((run.path / "manifest.json").read_text())
    assert manifest["epoch_drafts"] == ["epochs/0", "epochs/1"]
    drafts = [run.path / "epochs" / n for n in ("0", "1")]
    for d in drafts:
        conf = json.loads((d / "config.json").read_text())
        assert conf["eagle3_runner"]["capture_ids"] == [0, 2, 3, 4]
        assert sorted(p.name for p in d.iterdir() if "optimizer" in p.name) == []
    # Two different drafts; the published one is speculators' best by validation loss, here the
    # last.
    w0, w1 = (load_file(str(d / "model.safetensors")) for d in drafts)
    final = load_file(str(run.path / "draft" / "model.safetensors"))
    assert not torch.equal(w0["fc.weight"], w1["fc.weight"])
    assert all(torch.equal(w1[k], final[k]) for k in final)


def test_a_failed_stage_publishes_nothing(first_run, tiny_model_dir, chats_jsonl):
    from runner.core.errors import StageError

    _, _, root = first_run
    # Passes the plan (a valid flag), fails inside the trainer: the data is not there.
    bad_flag = "+train.extra_args.data_path=/nonexistent/dataset"
    cfg = compose(tiny(tiny_model_dir, chats_jsonl, root, "train.lr=7e-4", bad_flag))
    before = {p.name for p in (root / "store" / "train").iterdir()}
    with pytest.raises(StageError):
        run_job(cfg)
    after = {p.name for p in (root / "store" / "train").iterdir()}
    assert after == before  # no new artifact and no temporary folder left behind
    # The FAILED run still shows what the stages before training read: its dataset.
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    (failed,) = client.search_runs(
        [client.get_experiment_by_name("eagle3").experiment_id], "attributes.status = 'FAILED'"
    )
    contexts = [t.value for i in failed.inputs.dataset_inputs for t in i.tags]
    assert "training" in contexts


def test_a_stage_outside_run_stages_must_be_in_the_store(
    first_run, tiny_model_dir, chats_jsonl, tmp_path
):
    from runner.core.errors import ConfigError

    cfg = compose(tiny(tiny_model_dir, chats_jsonl, tmp_path, "run.stages=[vocab]"))
    with pytest.raises(ConfigError) as info:  # found in preflight, before anything loads
        run_job(cfg)
    assert info.value.key == "run.stages" and "run.stages=[prepare]" in info.value.message


def test_a_cached_mapping_made_for_another_tokenizer_is_refused(
    first_run, tiny_model_dir, chats_jsonl
):
    from runner.core.errors import StageError

    _, first, root = first_run
    manifest_path = first.results["vocab"].path / "manifest.json"
    original = manifest_path.read_text()
    m = json.loads(original)
    m["model"]["tokenizer_id"] = (
        "0123456789abcdef"  # as if copied in from a run on another tokenizer
    )
    manifest_path.write_text(json.dumps(m))
    try:
        with pytest.raises(StageError, match="another tokenizer"):
            run_job(compose(tiny(tiny_model_dir, chats_jsonl, root)))
    finally:
        manifest_path.write_text(original)


def test_extraction_self_test_passed_and_catches_a_wrong_final_slot(
    first_run, tiny_model_dir, monkeypatch
):
    import datasets

    import stages.extract.transformers_backend as tb
    from runner.assets.target_facts import resolve_target
    from runner.core.schema import typed

    cfg, result, _ = first_run
    m = json.loads((result.results["extract"].path / "manifest.json").read_text())["metrics"]
    assert m["selftest_slots"] == 4 and m["selftest_next_token_agreement"] == 1.0
    # One layer off for the final slot (layer n-2's output): the target's own head no longer
    # reproduces its next tokens, and the self-test stops extraction.
    real = tb.hook_point
    monkeypatch.setattr(tb, "hook_point", lambda k, n: ("post", k - 2) if k == n else real(k, n))
    run_cfg = typed(cfg)
    facts = resolve_target(run_cfg, Path(run_cfg.run.output_root)).facts
    backend = tb.TransformersBackend.from_config(run_cfg, facts)
    rows = datasets.load_from_disk(str(result.results["prepare"].path / "dataset")).with_format(
        "torch"
    )
    with pytest.raises(RuntimeError, match="self-test"):
        backend.self_test(rows[0]["input_ids"])
    backend.close()


def test_fp8_storage_halves_the_files_and_trains_with_no_conversion(
    first_run, tiny_model_dir, chats_jsonl, tmp_path
):
    from hs_connectors.fp8_utils import SCALES_KEY, dequantize_fp8_tensor

    _, bf16, _ = first_run
    fp8 = run_job(compose(tiny(tiny_model_dir, chats_jsonl, tmp_path, "extract.storage=fp8")))
    e16, e8 = bf16.results["extract"], fp8.results["extract"]
    assert e8.key != e16.key  # the storage is part of the extraction key
    f16 = load_file(str(e16.path / "hidden_states" / "hs_0.safetensors"))
    f8 = load_file(str(e8.path / "hidden_states" / "hs_0.safetensors"))
    assert f8["hidden_states"].dtype == torch.float8_e4m3fn and f8[SCALES_KEY].shape[1:] == (1, 1)
    torch.testing.assert_close(  # hs-connectors' reader gives back the states, to fp8 precision
        dequantize_fp8_tensor(f8["hidden_states"], f8[SCALES_KEY]).float(),
        f16["hidden_states"].float(),
        atol=0.1,
        rtol=0.07,
    )
    # 4 slots x 64 values: 512 + 8 bytes a token in bf16 (1,024 + 8 in float32, the target's
    # format on a CPU without native bf16), 256 + 12 in fp8 (headers aside).
    ratio = e8.metrics["bytes_per_token"] / e16.metrics["bytes_per_token"]
    expected = (4 * 64 + 12) / (4 * 64 * DTYPE_BYTES[HERE] + 8)
    assert 0.85 * expected < ratio < 1.2 * expected, (ratio, expected)
    # Statistics come from the full-precision values: identical to the bf16 run's.
    stats = [json.loads((e.path / "layer_stats.json").read_text()) for e in (e16, e8)]
    assert stats[0] == stats[1]
    # speculators' fp8 backend trains on the files as they are, to nearly the same losses.
    t16, t8 = bf16.results["train"].metrics, fp8.results["train"].metrics
    assert "fp8" in fp8.results["train"].path.joinpath("manifest.json").read_text()
    assert t8["steps"] == t16["steps"]
    assert t8["final_loss"] == pytest.approx(t16["final_loss"], rel=0.1)


def test_the_plans_costs_take_this_stores_own_rates(first_run, tiny_model_dir, chats_jsonl):
    """A finished stage in the store gives the plan's cost estimate its rate, but only on the
    same hardware (name and GPU kind, from the manifest; runner/engine/costs.py)."""
    from types import SimpleNamespace

    from runner.core.schema import typed
    from runner.core.store import ArtifactStore
    from runner.engine.costs import measured

    cfg, _result, root = first_run
    store = ArtifactStore(root)
    here = SimpleNamespace(cfg=typed(cfg), store=store)
    for stage in ("extract", "train"):
        # The store's latest of the stage (other tests of this module add to the same store).
        art = measured(here, stage)
        assert art is not None and art.key == store.latest(stage).key
        assert art.manifest["hardware"] == {
            "name": "cpu",
            "gpu_kind": None,
            "num_gpus": 0,
            "num_nodes": 1,
        }
    elsewhere = typed(compose(tiny(tiny_model_dir, chats_jsonl, root, "hardware.name=other")))
    assert measured(SimpleNamespace(cfg=elsewhere, store=store), "train") is None


def test_the_export_check_passes_the_published_draft_and_catches_broken_ones(first_run, tmp_path):
    """After training, the published folder is checked (head, vocab mapping against the vocab
    stage's files, layer types, capture ids) and reloaded through speculators for one
    validation pass, whose accuracy agrees with training's. Broken copies of it are caught."""
    import shutil

    from safetensors.torch import save_file

    from stages.train.draft_check import Expected, check_draft

    _, first, _ = first_run
    art = first.results["train"]
    manifest = json.loads((art.path / "manifest.json").read_text())
    assert manifest["export_check"]["problems"] == []
    assert any("equal to the vocab stage's" in line for line in manifest["export_check"]["lines"])
    m = art.metrics
    assert m["export_problems"] == 0
    assert abs(m["export_full_acc_0"] - m["trained_full_acc_0"]) <= 0.05
    draft, vocab = art.path / "draft", first.results["vocab"].path
    conf = json.loads((draft / "config.json").read_text())
    expect = Expected(
        draft_vocab_size=512,
        target_vocab_size=len(np.load(vocab / "t2d.npy")),
        hidden_size=conf["transformer_layer_config"]["hidden_size"],
        num_layers=1,
        sliding_window=2048,
        full_attention_layers=[],
        aux_layers=conf["eagle_aux_hidden_state_layer_ids"],
        capture_ids=[0, 2, 3, 4],
    )
    assert check_draft(draft, vocab, expect).problems == []

    def broken(edit_weights=None, edit_conf=None) -> list[str]:
        copy = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        shutil.copytree(draft, copy)
        if edit_weights:
            w = load_file(str(copy / "model.safetensors"))
            edit_weights(w)
            save_file(w, str(copy / "model.safetensors"))
        if edit_conf:
            c = json.loads((copy / "config.json").read_text())
            edit_conf(c)
            (copy / "config.json").write_text(json.dumps(c))
        return check_draft(copy, vocab, expect).problems

    assert "no lm_head.weight" in broken(edit_weights=lambda w: w.pop("lm_head.weight"))[0]
    flipped = broken(edit_weights=lambda w: w.update(d2t=torch.flip(w["d2t"], [0])))
    assert any("differ from the vocab stage's" in p for p in flipped)
    wrong_ids = broken(edit_conf=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2]))
    assert "vLLM would feed it other layers" in wrong_ids[0]
    full = broken(edit_conf=lambda c: c["transformer_layer_config"].update(layer_types=["x"]))
    assert "train.full_attention_layers" in full[0]
