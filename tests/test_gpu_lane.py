"""The GPU lane (`make test-gpu`, marker `gpu`): the production path on a CUDA GPU with vLLM's
CUDA build, on the embedded default's real target (SmolLM2-135M-Instruct) and real data.
Skipped cleanly on a machine without a GPU (CI has none).

What it covers, each with the figures it prints (`GPU-FIGURES` lines) for docs/benchmarks.md:
- the GPU recipe trained with every epoch's draft kept, then the whole pipeline evaluated with
  the trained draft: acceptance per set and per position, the warm speed ratio at concurrency 1
  and at batch (with its spread), and every output that leaves the target's greedy path
  explained (near tie or mismatch);
- that speed ratio against a second measurement of the same warm servers by other code
  (eval.speed_check): within 10%;
- the learning curve: each epoch's draft served, both prompt sets;
- `extract=vllm` against the in-process backend on the same rows: equal token ids, states within
  bf16 of each other, and both token rates with the server's start apart;
- online training on the one GPU, the server sharing it (extract.share_gpu), against offline;
- `regenerate=vllm`: the target's own answers through the server;
- a GPU training stopped by SIGTERM resumes from its checkpoint and redoes no step;
- the published card's `vllm serve` command serving the draft.
The Kimi-K2.5 miniature's GPU test is in tests/test_kimi_miniature.py, the fused loss's in
tests/test_train_resume.py. dev/gpu_lane.sh runs the parts that measure no speed side by
side (each server with a share of the memory) and the speed figures alone.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import (
    compose,
    gpu_lane_overrides,
    run_job,
    run_runner,
    run_until,
    serve_card,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPU = [
    "hardware=gpu1",
    "data.num_samples=2000",
    "train.epochs=3",
    "train.keep_epoch_drafts=true",
    # The learning curve serves each epoch's draft itself; the pipeline evaluates the last.
    "eval.choose_epoch=false",
    "eval.num_prompts=80",
    *gpu_lane_overrides(),
]
UP_TO_TRAIN = "run.stages=[prepare,extract,vocab,train]"


def _figures(name: str, values: dict) -> None:
    """One line the lane's log keeps for docs/install.md."""
    print(f"GPU-FIGURES {name} {json.dumps(values, default=str)}", flush=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return Path(os.environ.get("EAGLE3_GPU_LANE_ROOT") or tmp_path_factory.mktemp("gpu_lane"))


@pytest.fixture(scope="module")
def pipeline(root):
    # The evaluation also measures each server's speed a second time by other code.
    over = [*GPU, f"run.output_root={root}", "run.name=gpu-lane", "eval.speed_check=true"]
    return run_job(compose(over))


def _train_figures(metrics: dict) -> dict:
    keep = ("val_", "train_s", "seconds_per_epoch", "tokens_per_s", "fetch_frac", "server_start")
    return {k: v for k, v in metrics.items() if k.startswith(keep) or k in ("steps", "resumes")}


@pytest.fixture(scope="module")
def trained(root):
    """The pipeline up to training: the lane's side-by-side part; the evaluation, which measures
    speed, runs alone later and reuses these stages."""
    return run_job(compose([*GPU, f"run.output_root={root}", "run.name=gpu-lane", UP_TO_TRAIN]))


def test_the_gpu_recipe_trains_and_keeps_every_epochs_draft(trained):
    run = trained
    train = run.results["train"]
    _figures(
        "train",
        {
            **_train_figures(train.metrics),
            "seconds": {k: r.seconds for k, r in run.results.items()},
            "extract_tokens_per_s": run.results["extract"].metrics.get("tokens_per_s"),
        },
    )
    manifest = json.loads((train.path / "manifest.json").read_text())
    assert manifest["epoch_drafts"] == ["epochs/0", "epochs/1", "epochs/2"]
    assert train.metrics["val_loss_epoch"] < train.metrics["first_loss"]


def test_the_pipeline_serves_its_draft_warm_and_explains_every_divergence(pipeline):
    ev = pipeline.results["evaluate"]
    m = ev.metrics
    rows = ev.stage.results(m, _cfg())
    _figures(
        "evaluate",
        {
            "sets": rows,
            **{
                k: m.get(k)
                for k in (
                    "speedup_c1",
                    "speedup_c1_std",
                    "speedup_batch",
                    "speedup_batch_std",
                    "draft_tok_s_c1",
                    "target_tok_s_c1",
                    "draft_tok_s_batch",
                    "target_tok_s_batch",
                    "speed_batch",
                    "identical_to_target_fraction",
                    "near_ties",
                    "mismatches",
                    "undetermined",
                    "server_start_s",
                )
            },
            "train": _train_figures(pipeline.results["train"].metrics),
            "seconds": {k: r.seconds for k, r in pipeline.results.items()},
        },
    )
    assert m["acceptance_length"] > 1.2  # a trained draft, not a random one
    # Every divergence explained; a mismatch (not a near tie) fails the identity check.
    assert m["speed_repeats"] == 5 and m["speed_batch"] == 80
    # A warm ratio: the 135M target is bound by kernel launches, so about 1x, not the 0.28x a
    # cold server measured.
    assert 0.5 < m["speedup_c1"] < 3.0 and m["speedup_c1_std"] < 0.2
    speeds = json.loads((ev.path / "speed.json").read_text())
    assert all(len(speeds[s][k]) == 5 for s in ("draft", "target") for k in ("c1", "batch"))
    identity = json.loads((ev.path / "identity.json").read_text())
    assert all(r["verdict"] != "mismatch" for r in identity)


def test_the_speed_ratio_agrees_with_an_independent_client_on_the_same_servers(pipeline):
    """eval.speed_check measured each warm server again with other code (its own client, warm-up
    and count: stages/evaluate/speed_check.py): the stage's ratio at concurrency 1 and at batch
    must be within 10% of that one's."""
    ev = pipeline.results["evaluate"]
    m = ev.metrics
    speeds = json.loads((ev.path / "speed.json").read_text())
    _figures(
        "speed_check",
        {
            **{k: v for k, v in m.items() if k.startswith(("speed_check", "speedup"))},
            **{k: m.get(k) for k in ("draft_compile_cold", "target_compile_cold")},
            "tok_s": {
                s: {
                    "stage": {k: statistics.median(speeds[s][k]) for k in ("c1", "batch")},
                    "check": {k: statistics.median(speeds[s]["check"][k]) for k in ("c1", "batch")},
                }
                for s in ("draft", "target")
            },
        },
    )
    assert all(len(speeds[s]["check"][k]) == 5 for s in speeds for k in ("c1", "batch"))
    # Two measurements further apart than their own repeats' noise: a fault in one of them.
    assert all(m[f"speed_check_{k}_within_noise"] == 1 for k in ("c1", "batch")), m
    # The goal: within 10% (one H200, 2026-12-03: -6% at concurrency 1, -14% at batch, passes of
    # under a second; the eighth, passes of >= 5 s: -4% and -10.6%, the check reading the fast
    # target 18% low; both clients now measure a steady state, benchmarks/speed_clients.py).
    for kind in ("c1", "batch"):
        assert abs(m[f"speed_check_{kind}_diff"]) <= 0.10, (kind, m)
    assert m["speed_check_agrees"] == 1


def _cfg():
    from runner.core.schema import typed

    return typed(compose([*GPU, "run.output_root=unused"]))


def test_vllm_extraction_matches_the_in_process_backend_on_the_gpu(root):
    # Rows of their own (not the pipeline's, extracted in the side-by-side phase): both rates
    # are measured here, in the lane's alone phase.
    over = [
        *GPU,
        f"run.output_root={root}",
        "data.num_samples=1500",
        "run.stages=[prepare,extract]",
    ]
    runs = {b: run_job(compose([*over, f"extract={b}"])) for b in ("transformers", "vllm")}
    arts = {b: r.results["extract"] for b, r in runs.items()}
    figures = {}
    for b, art in arts.items():
        manifest = json.loads((art.path / "manifest.json").read_text())
        figures[b] = {
            k: v
            for k, v in manifest["metrics"].items()
            if "tokens_per_s" in k or k.endswith("_s") or k == "tokens"
        }
    worst = []
    for f in sorted((arts["vllm"].path / "hidden_states").glob("*.safetensors"))[:50]:
        a = load_file(str(f))
        b = load_file(str(arts["transformers"].path / "hidden_states" / f.name))
        assert torch.equal(a["token_ids"], b["token_ids"]), f.name
        ha, hb = a["hidden_states"].float(), b["hidden_states"].float()
        err = ((ha - hb).norm(dim=(0, 2)) / hb.norm(dim=(0, 2))).tolist()
        worst = [max(x, y) for x, y in zip(worst or err, err, strict=True)]
    figures["relative_error_per_slot"] = worst
    _figures("extract", figures)
    # bf16 against bf16 through different kernels: each slot within a few percent.
    assert max(worst) < 0.08, worst


def test_regeneration_through_vllm_on_the_gpu(root):
    run = run_job(
        compose(
            [
                *GPU,
                f"run.output_root={root}",
                "data.num_samples=64",
                "regenerate=vllm",
                "run.stages=[regenerate]",
            ]
        )
    )
    m = run.results["regenerate"].metrics
    _figures("regenerate", m)
    assert m.get("conversations", 0) >= 32 or m.get("rows", 0) >= 32, m


def test_the_published_cards_command_serves_the_draft(pipeline, root, tmp_path):
    """The card's command for the evaluating machine, pasted as printed (only the port
    changed), serves the published folder on the GPU with its draft."""
    from runner.commands.publish import main as publish

    out = tmp_path / "published"
    assert publish([str(out), "--output-root", str(root), "--run", pipeline.run_id]) == 0
    _figures("card", serve_card(out, tmp_path / "card.log", 900))


def test_the_learning_curve_each_epochs_draft_served(trained, root):
    """Served acceptance for every epoch's draft of the GPU-recipe run, both prompt sets (the
    draft alone: no speed or identity, which the pipeline's evaluation measures)."""
    train = trained.results["train"]
    curve = {}
    for rel in json.loads((train.path / "manifest.json").read_text())["epoch_drafts"]:
        over = [
            *GPU,
            f"run.output_root={root}",
            f"eval.draft={train.path / rel}",
            "eval.compare_target=false",
            # 40 a set: vLLM 0.26 gives no per-request acceptance, so each prompt's interval
            # costs its own request at concurrency 1, three drafts over.
            "eval.num_prompts=40",
            "run.stages=[evaluate]",
        ]
        ev = run_job(compose(over)).results["evaluate"]
        curve[rel] = ev.stage.results(ev.metrics, _cfg())
    _figures("learning_curve", curve)
    first, last = (curve[k][0]["acceptance_length"] for k in (min(curve), max(curve)))
    assert last >= first - 0.05, curve  # more tokens trained does not make the draft worse


def test_online_training_shares_the_one_gpu_with_its_server(root):
    """extract=online on one GPU: the server takes extract.share_gpu of its memory and training
    the rest; its steady training rate against the offline pipeline's."""
    over = [
        *GPU,
        f"run.output_root={root}",
        "extract=online",
        "extract.share_gpu=0.15",
        "train.epochs=1",
        "train.keep_epoch_drafts=false",
        UP_TO_TRAIN,
    ]
    run = run_job(compose(over))
    m = run.results["train"].metrics
    _figures("online", _train_figures(m))
    served = json.loads((run.results["train"].path / "manifest.json").read_text())["served"]
    assert served["gpus"] == ["0"] and "0.15" in served["server_args"]
    assert m["steps"] > 0 and m["tokens_per_s_median"] > 0


def test_a_stopped_gpu_training_resumes_and_redoes_no_step(root, tmp_path):
    """SIGTERM in a GPU-recipe training: the runner checkpoints and exits 143; the same command
    resumes mid-run on the GPU and redoes no step."""
    cmd = [
        sys.executable,
        "-m",
        "runner",
        *GPU,
        f"run.output_root={tmp_path}",
        "data.num_samples=400",
        "train.epochs=2",
        "train.keep_epoch_drafts=false",
        "train.checkpoint_every=0.25",
        "train.echo_steps=true",
        UP_TO_TRAIN,
    ]
    code, out = run_until(cmd, "'global_step': 20", signal.SIGTERM, timeout=900)
    assert code == 143, out[-3000:]
    proc = run_runner(cmd, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (art,) = [p for p in (tmp_path / "store" / "train").iterdir() if not p.name.startswith(".")]
    m = json.loads((art / "manifest.json").read_text())["metrics"]
    _figures("resume", _train_figures(m) | {"steps_redone": m["steps_redone"]})
    assert (m["resumes"], m["steps_redone"]) == (1, 0)


def test_the_gain_by_concurrency_and_against_a_baseline_draft(trained, root):
    """eval.concurrency and eval.baseline_draft on the GPU: the trained draft's gain over the
    target alone at 1, 4, 16 and 64 closed-loop streams with intervals and the crossover, each
    server's KV capacity from vLLM's start-up line, and the draft against its own first epoch's
    draft served as the baseline on the same prompts (a paired verdict per set)."""
    train = trained.results["train"]
    over = [
        *GPU,
        f"run.output_root={root}",
        "run.name=gpu-lane-concurrency",
        "eval.prompts=[mtbench,humaneval]",
        "eval.concurrency=[1,4,16,64]",
        "eval.speed_repeats=3",
        f"eval.baseline_draft={train.path / 'epochs' / '0'}",
        "eval.gates=warn",  # a 135M target's identity and floor are the pipeline test's
    ]
    ev = run_job(compose(over)).results["evaluate"]
    m = ev.metrics
    levels = json.loads((ev.path / "concurrency.json").read_text())
    rows = json.loads((ev.path / "baseline.json").read_text())
    _figures(
        "concurrency",
        {
            "levels": levels,
            "crossover": m.get("speed_crossover"),
            "kv": {k: v for k, v in m.items() if "kv_" in k},
        },
    )
    _figures("baseline", rows)
    assert [r["concurrency"] for r in levels] == [1, 4, 16, 64]
    assert all(r["draft_tok_s"] > 0 and r["target_tok_s"] > 0 for r in levels)
    assert m["draft_kv_cache_tokens"] > 0 and 0 <= m["kv_cost"] < 1
    assert [r["set"] for r in rows] == ["mtbench", "humaneval"]
    assert all(r["verdict"] in ("better", "within noise", "worse") for r in rows)
