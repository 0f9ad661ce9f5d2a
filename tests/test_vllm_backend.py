"""Parity of the two extraction backends on the embedded default (real SmolLM2-135M-Instruct, real
ShareGPT rows, real vLLM on this CPU), and the vLLM backend's resume and failure behaviour.

CI runs this lane; select it alone with `pytest -m vllm`. It takes several minutes: two vLLM
extractions, two trainings, two vLLM evaluations, plus a resume and two failure runs.

Tolerances, stated:
- hidden states: per captured slot (the pre-norm final one included), the relative L2 error of the
  vLLM states against an fp32 transformers forward is at most 1.5x that of the bf16 transformers
  states against the same fp32 forward, i.e. vLLM's states are as exact as bf16 allows;
- drafts: trained on each backend's states with the same seed, served by vLLM on the same prompts,
  their mean acceptance lengths differ by at most ACCEPTANCE_TOLERANCE, and both beat a random
  draft (1.00) clearly.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runner.errors import StageError
from tests.conftest import REPO, compose, run_job, serve_card

pytestmark = pytest.mark.vllm

REDUCED = [
    "data.num_samples=160",
    "train.epochs=1",
    "eval.num_prompts=40",
    "eval.max_new_tokens=64",
    "eval.compare_target=false",
]
ACCEPTANCE_TOLERANCE = 0.03
SAMPLES_COMPARED = 12


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm_lane")


@pytest.fixture(scope="module")
def runs(root):
    out = {}
    for backend in ("transformers", "vllm"):
        out[backend] = run_job(
            compose(
                [
                    *REDUCED,
                    f"extract={backend}",
                    f"run.output_root={root}",
                    f"run.name=parity-{backend}",
                ]
            )
        )
    return out


def _servers_under(root: Path) -> list[int]:
    """vLLM servers still running whose command line names this lane's output root."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "vllm.entrypoints.openai.api_server" in cmd and str(root) in cmd:
            pids.append(int(proc.name))
    return pids


def _rel(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    return float((a - b).pow(2).sum()), float(b.pow(2).sum())


def test_hidden_states_match_transformers_within_bf16(runs):
    from transformers import AutoModelForCausalLM

    from stages.extract.transformers_backend import TransformersBackend

    hf_dir = runs["transformers"].results["extract"].path
    vl_dir = runs["vllm"].results["extract"].path
    ids = json.loads((hf_dir / "capture_ids.json").read_text())
    assert json.loads((vl_dir / "capture_ids.json").read_text()) == ids == [2, 15, 27, 30]
    manifest = json.loads((vl_dir / "manifest.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(manifest["model"]["path"], dtype=torch.float32)
    exact = TransformersBackend(model, tuple(ids), 30, batch_size=1)
    n = len(ids)
    err_v, err_h, norm, max_abs = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
    for i in range(SAMPLES_COMPARED):
        h = load_file(str(hf_dir / "hidden_states" / f"hs_{i}.safetensors"))
        v = load_file(str(vl_dir / "hidden_states" / f"hs_{i}.safetensors"))
        assert torch.equal(h["token_ids"], v["token_ids"])
        assert (
            h["hidden_states"].shape == v["hidden_states"].shape
            and v["hidden_states"].dtype == torch.bfloat16
        )
        ref = exact.forward([h["token_ids"]])[0]
        for s in range(n):
            hv, vv, r = (
                h["hidden_states"][:, s].float(),
                v["hidden_states"][:, s].float(),
                ref[:, s],
            )
            d, nr = _rel(vv, r)
            err_v[s] += d
            norm[s] += nr
            err_h[s] += _rel(hv, r)[0]
            max_abs[s] = max(max_abs[s], float((vv - hv).abs().max()))
    rows = []
    for s, lid in enumerate(ids):
        rv, rh = (err_v[s] / norm[s]) ** 0.5, (err_h[s] / norm[s]) ** 0.5
        rows.append((lid, rv, rh, max_abs[s]))
        print(
            f"slot {s} (vLLM id {lid}): rel. L2 vs fp32: vLLM {rv:.4f}, "
            f"transformers bf16 {rh:.4f}; "
            f"max |vLLM - transformers| {max_abs[s]:.3g}"
        )
    for lid, rv, rh, _ in rows:
        assert rv <= 1.5 * rh, f"vLLM id {lid}: relative error {rv:.4f} vs bf16's own {rh:.4f}"


def test_drafts_trained_on_either_backend_accept_alike_in_vllm(runs):
    acc = {b: runs[b].objective for b in runs}
    ev = {
        b: json.loads((runs[b].results["evaluate"].path / "summary.json").read_text()) for b in runs
    }
    for b in runs:
        print(
            f"{b}: served acceptance length {acc[b]:.3f} (per position "
            f"{[round(ev[b][f'acceptance_pos_{i}'], 3) for i in range(3)]}), "
            "teacher-forced estimate "
            f"{ev[b].get('teacher_forced_acceptance_length', float('nan')):.3f}, "
            f"extraction {runs[b].results['extract'].metrics['tokens_per_s']:.0f} tok/s"
        )
    assert min(acc.values()) > 1.03, (
        "a draft barely above a random one (1.00): training saw broken states"
    )
    assert abs(acc["vllm"] - acc["transformers"]) <= ACCEPTANCE_TOLERANCE


def test_a_published_draft_serves_with_the_command_in_its_card(runs, root, tmp_path):
    """The card's command for the evaluating machine, pasted as printed (only the port changed),
    serves the published folder: vLLM loads it as an EAGLE-3 speculator and counts drafts."""
    from runner.publish import main as publish

    out = tmp_path / "published"
    assert publish([str(out), "--output-root", str(root), "--run", runs["vllm"].run_id]) == 0
    serve_card(out, tmp_path / "card.log", 600)


def test_a_draft_packed_here_and_unpacked_elsewhere_evaluates_alike(runs, root, tmp_path):
    """Trained on one box, evaluated on another: the packed draft (without the target's
    embeddings) is unpacked against this box's target and evaluated alone (eval.draft), with the
    same acceptance as the run that trained it."""
    from runner.transfer import main as transfer

    trained = runs["vllm"]
    target = trained.target.facts.path
    draft = trained.results["train"].path / "draft"
    packed, back = tmp_path / "draft.packed", tmp_path / "unpacked"
    assert transfer(["pack", str(draft), str(packed), "--target", target]) == 0
    assert transfer(["unpack", str(packed), str(back), "--target", target]) == 0
    alone = run_job(
        compose(
            [
                *REDUCED,
                f"run.output_root={root}",
                f"eval.draft={back}",
                "run.stages=[evaluate]",
                "run.name=elsewhere",
            ]
        )
    )
    assert alone.stages == {"evaluate": "computed"}
    print(
        f"acceptance length: trained here {trained.objective:.3f}, packed and unpacked "
        f"{alone.objective:.3f}"
    )
    assert abs(alone.objective - trained.objective) <= 0.01


def test_regeneration_backends_give_the_same_greedy_answers(root):
    """The default target regenerates the same conversations greedily with vLLM and with
    transformers (first turns, 48 tokens each): the same ids, or the difference reported and
    shown to be a bf16 near-tie."""
    base = [
        "data.num_samples=12",
        "regenerate.max_tokens=48",
        "regenerate.max_bad_fraction=1",
        "run.stages=[regenerate]",
        f"run.output_root={root}",
    ]
    recs = {}
    for backend in ("vllm", "transformers"):
        art = run_job(compose([*base, f"regenerate={backend}"])).results["regenerate"]
        text = (art.path / "regenerated" / "source_0.jsonl").read_text()
        recs[backend] = [json.loads(line) for line in text.splitlines()]
    pairs = list(zip(recs["vllm"], recs["transformers"], strict=True))
    assert len(pairs) == 12
    assert all(a["conversations"][:-1] == b["conversations"][:-1] for a, b in pairs), "same prompts"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = str(root / "models" / "smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(target)
    fp32 = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    same, prefixes, gaps = 0, [], []
    for a, b in pairs:
        x, y = a["token_ids"][0], b["token_ids"][0]
        i = next((j for j, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), None)
        if i is None:
            same += 1
            prefixes.append(len(x))
            continue
        prefixes.append(i)
        # Where they part, the two engines' tokens are the fp32 forward's two best, nearly tied:
        # bf16 rounding picked differently, not a wrong prompt, cache or mask.
        prompt = tok.apply_chat_template(
            a["conversations"][:-1], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        with torch.inference_mode():
            logits = fp32(torch.tensor([[*prompt, *x[:i]]])).logits[0, -1]
        assert set(torch.topk(logits, 2).indices.tolist()) == {x[i], y[i]}, (i, x[i], y[i])
        gaps.append(abs(float(logits[x[i]] - logits[y[i]])))
    print(
        f"regenerate, greedy, vLLM vs transformers: {same} of {len(pairs)} first answers "
        f"identical over 48 tokens; the others part after {[p for p in prefixes if p < 48]} "
        f"tokens, each at a near-tie (fp32 logit gaps {[round(g, 3) for g in gaps]})"
    )
    assert all(g < 0.25 for g in gaps), gaps


def test_vllm_extraction_resumes_and_redoes_unreadable_files(runs, root):
    """The resumed artifact holds the same files as the uninterrupted run's."""
    art = runs["vllm"].results["extract"].path
    scratch = root / "scratch" / f"extract-{art.name}" / "hidden_states"
    scratch.mkdir(parents=True)
    for i in range(5):
        shutil.copy(art / "hidden_states" / f"hs_{i}.safetensors", scratch)
    good = (art / "hidden_states" / "hs_5.safetensors").read_bytes()
    (scratch / "hs_5.safetensors").write_bytes(good[: len(good) // 3])  # an interrupted copy
    result = run_job(
        compose(
            [
                *REDUCED,
                "extract=vllm",
                f"run.output_root={root}",
                "run.stages=[prepare,extract]",
                "run.force=[extract]",
                "run.name=resume",
            ]
        )
    )
    m = result.results["extract"].metrics
    assert (m["resumed_samples"], m["redone_unreadable"]) == (5, 1)
    out = result.results["extract"].path
    redone = load_file(str(out / "hidden_states" / "hs_5.safetensors"))
    assert redone["hidden_states"].shape[1] == 4 and torch.isfinite(redone["hidden_states"]).all()
    # Every row: the same token ids, and the same states up to bf16 noise of other batch shapes.
    one = sorted(p.name for p in (art / "hidden_states").glob("hs_*.safetensors"))
    assert sorted(p.name for p in (out / "hidden_states").glob("hs_*.safetensors")) == one
    for name in one:
        got, ref = (load_file(str(d / "hidden_states" / name)) for d in (out, art))
        assert torch.equal(got["token_ids"], ref["token_ids"]), name
        diff = (got["hidden_states"].float() - ref["hidden_states"].float()).norm()
        assert diff <= 0.02 * ref["hidden_states"].float().norm(), name  # batch shapes: bf16 noise
    assert not scratch.exists(), "the resume folder is removed once the artifact is published"


def test_vllm_extraction_can_store_fp8_from_full_precision_values(runs, root):
    from hs_connectors.fp8_utils import SCALES_KEY, dequantize_fp8_tensor

    result = run_job(
        compose(
            [
                *REDUCED,
                "data.num_samples=16",
                "extract=vllm",
                "extract.storage=fp8",
                f"run.output_root={root}",
                "run.stages=[prepare,extract]",
                "run.name=fp8",
            ]
        )
    )
    got = load_file(str(result.results["extract"].path / "hidden_states" / "hs_0.safetensors"))
    ref = load_file(
        str(runs["vllm"].results["extract"].path / "hidden_states" / "hs_0.safetensors")
    )
    assert got["hidden_states"].dtype == torch.float8_e4m3fn and SCALES_KEY in got
    assert torch.equal(got["token_ids"], ref["token_ids"])  # the same first row
    back = dequantize_fp8_tensor(got["hidden_states"], got[SCALES_KEY]).float()
    torch.testing.assert_close(back, ref["hidden_states"].float(), atol=0.5, rtol=0.07)
    m = result.results["extract"].metrics
    assert m["bytes_per_token"] < 0.6 * runs["vllm"].results["extract"].metrics["bytes_per_token"]


def test_a_request_that_keeps_failing_names_the_sample_and_leaves_no_server(root):
    overrides = [
        "extract=vllm",
        "data.num_samples=8",
        f"run.output_root={root}",
        "run.stages=[prepare,extract]",
        # vLLM takes the last of repeated flags: every row is now too long for the server.
        "hardware.vllm.extra_args=[--max-model-len,'16']",
        "extract.max_retries=1",
        "run.name=failing",
    ]
    with pytest.raises(
        StageError,
        match=r"failed for sample \d+ .*after 1 retries each \(extract.max_retries\); "
        r"sample \d+: .*maximum context length",
    ):
        run_job(compose(overrides))
    assert _servers_under(root) == []


def _runner_until(args: list[str], root: Path, started) -> subprocess.Popen:
    """`python -m runner <args>` in a child, read until a line satisfies `started`; a server
    must be up."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", *args, f"run.output_root={root}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if started(line):
            break
    assert _servers_under(root), "".join(seen[-20:])
    return proc


def test_ctrl_c_while_the_server_loads_stops_it(root):
    proc = _runner_until(
        [
            "extract=vllm",
            "data.num_samples=8",
            "run.stages=[prepare,extract]",
            "run.name=interrupted",
        ],
        root,
        lambda line: "[vllm:extract] Resolved architecture" in line,
    )  # the server is up and logging its milestones
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0
    deadline = time.time() + 30
    while _servers_under(root) and time.time() < deadline:
        time.sleep(0.5)
    assert _servers_under(root) == [], rest[-2000:]


def test_a_server_that_dies_mid_extraction_ends_the_stage_with_its_log(runs, root):
    proc = _runner_until(
        [
            *REDUCED,
            "extract=vllm",
            "run.stages=[prepare,extract]",
            "run.force=[extract]",
            "run.name=server-killed",
        ],
        root,
        lambda line: "[extract] requesting the hidden states of" in line,
    )  # main pass begun
    for pid in _servers_under(root):
        os.kill(pid, signal.SIGKILL)  # e.g. the OOM killer
    t0 = time.time()
    rest = proc.communicate(timeout=300)[0]
    assert proc.returncode == 1, rest[-3000:]
    assert time.time() - t0 < 120, "the stage kept retrying against a dead server"
    assert "exited with code -9" in rest and "vllm_extract.log" in rest
    assert _servers_under(root) == []


# -- online training (extract.mode=online) and a server that already runs -----------------------


@pytest.fixture(scope="module")
def online_run(runs, root):
    """The same rows and settings as the offline runs, trained online against a vLLM server."""
    return run_job(
        compose([*REDUCED, "extract=online", f"run.output_root={root}", "run.name=online"])
    )


def test_online_training_stores_nothing_and_accepts_like_offline(runs, online_run, root):
    ext = online_run.results["extract"]
    assert not (ext.path / "hidden_states").exists() and ext.metrics["bytes"] == 0
    served = json.loads((ext.path / "served.json").read_text())
    assert served["capture_ids"] == [2, 15, 27, 30] and served["vllm"] != "absent"
    assert "extract_hidden_states" in " ".join(served["server_args"])
    train = online_run.results["train"]
    manifest = json.loads((train.path / "manifest.json").read_text())
    assert "vllm_endpoint" in manifest["speculators_settings"]
    assert manifest["served"]["probe_shape"][1] == 4
    # speculators deletes each fetched file once loaded: nothing piles up while training.
    assert not list((root / "scratch").glob("train-*/online_states/*.safetensors"))
    offline, online = runs["vllm"], online_run
    t_off = offline.results["train"].metrics["seconds_per_epoch"]
    t_on = online.results["train"].metrics["seconds_per_epoch"]
    print(
        f"acceptance length offline (vLLM states) {offline.objective:.3f}, online "
        f"{online.objective:.3f}; seconds per epoch offline {t_off:.1f}, online {t_on:.1f} "
        f"({t_on / t_off:.2f}x), online server start "
        f"{online.results['train'].metrics['server_start_s']:.1f} s"
    )
    # The same vLLM states, fetched rather than read: only bf16 batching noise differs.
    assert abs(online.objective - offline.objective) <= ACCEPTANCE_TOLERANCE


@pytest.fixture(scope="module")
def existing_server(online_run, root):
    """A vLLM server started by the test with the flags the online record says it needs, with
    its engine config readable (VLLM_SERVER_DEV_MODE=1), as a user would start it on a serving
    box."""
    from runner.vllm_server import VllmServer

    served = json.loads((online_run.results["extract"].path / "served.json").read_text())
    staging = root / "endpoint_states"
    args = [
        a.replace("<train work folder>/online_states", str(staging)) for a in served["server_args"]
    ]
    server = VllmServer.from_config(
        compose(REDUCED),
        served["model"],
        args,
        root / "endpoint.log",
        label="test-endpoint",
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    with server:
        yield server.base


def test_an_existing_server_is_checked_before_any_work_and_then_used(existing_server, root):
    from runner.errors import ConfigError

    base = [*REDUCED, f"run.output_root={root}", f"hardware.vllm.endpoint={existing_server}"]
    up_to_train = ["extract=online", "run.stages=[prepare,extract,vocab,train]"]
    # Refused in the plan, naming the setting: longer rows than the server takes ...
    with pytest.raises(ConfigError) as info:
        run_job(compose([*base, *up_to_train, "data.max_seq_len=1024", "run.plan_only=true"]))
    assert info.value.key == "data.max_seq_len"
    # ... an evaluation against a server that extracts (it serves no draft) ...
    with pytest.raises(ConfigError) as info:
        run_job(compose([*base, "run.stages=[evaluate]", "run.plan_only=true"]))
    assert info.value.key == "hardware.vllm.endpoint"
    assert "extract_hidden_states" in info.value.message
    # ... and a dtype it does not run in.
    with pytest.raises(ConfigError) as info:
        run_job(compose([*base, *up_to_train, "hardware.dtype=float16", "run.plan_only=true"]))
    assert info.value.key == "hardware.dtype"
    # Online training against it (a new seed: a new draft), and an offline extraction through it.
    trained = run_job(compose([*base, *up_to_train, "train.seed=1", "run.name=endpoint-online"]))
    served = json.loads((trained.results["train"].path / "manifest.json").read_text())["served"]
    assert served["endpoint"] == existing_server and served["server_args"] is None
    assert trained.results["train"].metrics["steps"] > 0
    offline = ["extract=vllm", "data.num_samples=16", "run.stages=[prepare,extract]"]
    extracted = run_job(compose([*base, *offline, "run.name=endpoint-offline"]))
    files = list((extracted.results["extract"].path / "hidden_states").glob("hs_*.safetensors"))
    assert len(files) == extracted.results["extract"].metrics["samples"] == 16
    assert not list(root.glob("endpoint_states/*.safetensors")), "files moved, none left behind"


def test_an_online_capture_layer_sweep_shares_one_server(root):
    """Two capture presets, online: one server with the union of their layers serves both jobs,
    each training on its own slots."""
    from tests.conftest import run_runner

    sweep = root / "online_sweep"
    proc = run_runner(
        [
            sys.executable,
            "-m",
            "runner",
            "-m",
            "extract=online",
            "model.capture_preset=default,late",
            "extract.superset_presets=[default,late]",
            "data.num_samples=40",
            "train.epochs=1",
            "run.stages=[prepare,extract,vocab,train]",
            f"run.output_root={sweep}",
            f"hydra.sweep.dir={sweep}/multirun",
        ],
        timeout=1200,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("[train:online] vLLM ready") == 1, "one server for the whole sweep"
    assert out.count("the sweep's server, already running") == 1
    drafts = list((sweep / "store" / "train").glob("*/manifest.json"))
    slots = sorted(json.loads(p.read_text())["slots"] for p in drafts)
    assert len(drafts) == 2 and slots[0] != slots[1]
    assert not _servers_under(sweep), "the shared server ends with the sweep"
