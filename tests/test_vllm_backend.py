"""Parity of the two extraction backends on the embedded default (real SmolLM2-135M-Instruct, real
ShareGPT rows, real vLLM on this CPU), and the vLLM backend's resume and failure behaviour.

CI runs this lane; select it with `pytest -m vllm`. This file takes the longest of the lane: a
vLLM extraction, a training and a vLLM evaluation shared by its tests, plus a resume, fp8, failure
runs, two servers and online training; tests/test_vllm_small_runs.py holds the lane's tests that
need none of these.

Tolerances, stated:
- hidden states: per captured slot (the pre-norm final one included), the relative L2 error of the
  vLLM states against an fp32 transformers forward is at most 1.5x that of the bf16 transformers
  states against the same fp32 forward, i.e. vLLM's states are as exact as bf16 allows;
- drafts: the draft trained on vLLM's states beats a random draft (1.00) clearly, and training
  online on the same states (fetched, not read) gives the same loss, step by step, within 1%.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runner.core.number_format import choose_dtype
from tests.conftest import compose, run_job, serve_card
from tests.vllm_lane import REDUCED, runner_until, servers_under

pytestmark = pytest.mark.vllm

SAMPLES_COMPARED = 6


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm_lane")


@pytest.fixture(scope="module")
def runs(root):
    """The reduced default extracted by vLLM, trained on and served.

    The transformers states it is compared with are computed in the test, on the samples
    compared (test_hidden_states_match_transformers_within_bf16): a whole transformers run
    extracted all of the lane's rows (about four minutes of CI) to compare six, and the stage's
    files and slots are checked against transformers by the e2e lane. The online run below trains
    from the same states and is held to offline's training, step by step."""
    return {
        "vllm": run_job(
            compose([*REDUCED, "extract=vllm", f"run.output_root={root}", "run.name=parity-vllm"])
        )
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    return float((a - b).pow(2).sum()), float(b.pow(2).sum())


def test_hidden_states_match_transformers_within_bf16(runs):
    import datasets
    from transformers import AutoModelForCausalLM

    from stages.extract.transformers_backend import TransformersBackend

    run = runs["vllm"]
    vl_dir = run.results["extract"].path
    ids = json.loads((vl_dir / "capture_ids.json").read_text())
    assert ids == [2, 15, 27, 30]
    manifest = json.loads((vl_dir / "manifest.json").read_text())
    path = manifest["model"]["path"]
    # The extract stage's transformers backend in the format the stage runs it (bf16 where the
    # CPU has it natively: the error bf16 itself makes), and in fp32 as the reference both are
    # measured against. Where the run computes in float32 the two are one, and vLLM's states
    # must match it to float32's own rounding.
    stage = getattr(torch, choose_dtype("cpu").dtype)
    backends = {
        dtype: TransformersBackend(
            AutoModelForCausalLM.from_pretrained(path, dtype=dtype), tuple(ids), 30, batch_size=1
        )
        for dtype in {stage, torch.float32}
    }
    rows = datasets.load_from_disk(str(run.results["prepare"].path / "dataset"))
    rows = rows.with_format("torch")
    n = len(ids)
    err_v, err_h, norm, max_abs = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
    for i in range(SAMPLES_COMPARED):
        v = load_file(str(vl_dir / "hidden_states" / f"hs_{i}.safetensors"))
        assert torch.equal(v["token_ids"], rows[i]["input_ids"]), f"sample {i}: not its row"
        assert v["hidden_states"].dtype == stage
        h = backends[stage].forward([v["token_ids"]])[0]
        ref = backends[torch.float32].forward([v["token_ids"]])[0]
        assert h.shape == v["hidden_states"].shape == ref.shape
        for s in range(n):
            hv, vv, r = h[:, s].float(), v["hidden_states"][:, s].float(), ref[:, s]
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
            f"transformers {stage} {rh:.4f}; "
            f"max |vLLM - transformers| {max_abs[s]:.3g}"
        )
    for lid, rv, rh, _ in rows:
        if stage == torch.float32:  # kernels summing in other orders, nothing more
            assert rv < 1e-3, f"vLLM id {lid}: relative error {rv:.2e} in float32"
        else:
            assert rv <= 1.5 * rh, f"vLLM id {lid}: relative error {rv:.4f} vs bf16's own {rh:.4f}"


def test_the_draft_trained_on_vllm_states_accepts_above_a_random_one(runs):
    run = runs["vllm"]
    ev = json.loads((run.results["evaluate"].path / "summary.json").read_text())
    print(
        f"vLLM states: served acceptance length {run.objective:.3f} (per position "
        f"{[round(ev[f'acceptance_pos_{i}'], 3) for i in range(3)]}), teacher-forced estimate "
        f"{ev.get('teacher_forced_acceptance_length', float('nan')):.3f}; extraction "
        f"{run.results['extract'].metrics['tokens_per_s']:.0f} tok/s"
    )
    assert run.objective > 1.03, (
        "a draft barely above a random one (1.00): training saw broken states"
    )


def test_a_published_draft_serves_with_the_command_in_its_card(runs, root, tmp_path):
    """The card's command for the evaluating machine, pasted as printed (only the port changed),
    serves the published folder: vLLM loads it as an EAGLE-3 speculator and counts drafts."""
    from runner.commands.publish import main as publish

    out = tmp_path / "published"
    assert publish([str(out), "--output-root", str(root), "--run", runs["vllm"].run_id]) == 0
    serve_card(out, tmp_path / "card.log", 600)


def test_a_draft_packed_here_and_unpacked_elsewhere_evaluates_alike(runs, root, tmp_path):
    """Trained on one box, evaluated on another: the packed draft (without the target's
    embeddings) unpacked against this box's target is the trained draft again, every tensor to
    the bit, so vLLM serves it as the run that trained it did; an evaluation of it alone
    (eval.draft) is planned. (Serving a draft from a folder, eval.draft, is the e2e lane's.)"""
    from runner.assets.transfer import main as transfer

    trained = runs["vllm"]
    target = trained.target.facts.path
    draft = trained.results["train"].path / "draft"
    packed, back = tmp_path / "draft.packed", tmp_path / "unpacked"
    assert transfer(["pack", str(draft), str(packed), "--target", target]) == 0
    assert transfer(["unpack", str(packed), str(back), "--target", target]) == 0
    mine, theirs = (load_file(str(d / "model.safetensors")) for d in (draft, back))
    assert sorted(mine) == sorted(theirs)
    assert all(torch.equal(mine[k], theirs[k]) and mine[k].dtype == theirs[k].dtype for k in mine)
    config = json.loads((draft / "config.json").read_text())
    assert json.loads((back / "config.json").read_text()) == config
    alone = [*REDUCED, f"run.output_root={root}", f"eval.draft={back}", "run.stages=[evaluate]"]
    planned = run_job(compose([*alone, "run.name=elsewhere", "run.plan_only=true"])).plan
    assert not planned.errors, planned.render()


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


def test_a_server_that_dies_mid_extraction_ends_the_stage_with_its_log(runs, root):
    proc = runner_until(
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
    for pid in servers_under(root):
        os.kill(pid, signal.SIGKILL)  # e.g. the OOM killer
    t0 = time.time()
    rest = proc.communicate(timeout=300)[0]
    assert proc.returncode == 1, rest[-3000:]
    assert time.time() - t0 < 120, "the stage kept retrying against a dead server"
    # The stage says the server is the reason and names its log: with the exit code when the
    # process is gone by then, else that it stopped answering (a busy machine once left the
    # killed server's process unreaped past the stage's end).
    assert "vllm_extract.log" in rest
    assert "exited with code -9" in rest or "stopped answering" in rest, rest[-3000:]
    assert servers_under(root) == []


def test_two_servers_write_the_files_one_writes_and_survive_losing_one(runs, root):
    """hardware.vllm.data_parallel=2: two servers share the rows; one killed mid-way (kill -9,
    as the OOM killer would), the other takes its rows. The files are those one server wrote:
    the same names and token ids, states within bf16 batching noise. On the first 32 of the
    shared run's rows (prepare keeps the same first rows for fewer samples): enough for the kill,
    at the 12th file, to land mid-way."""
    import threading

    two = root / "two_servers"
    done = two / "scratch"
    killed: list[int] = []

    def kill_the_second_once_files_come() -> None:
        deadline = time.time() + 900
        while time.time() < deadline and not killed:
            if len(list(done.glob("extract-*/hidden_states/hs_*.safetensors"))) >= 12:
                for pid in servers_under(two):
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                    if b"vllm_staging/s1" in cmd:
                        os.killpg(pid, signal.SIGKILL)  # its own group: engine and all
                        killed.append(pid)
            time.sleep(0.2)

    killer = threading.Thread(target=kill_the_second_once_files_come, daemon=True)
    killer.start()
    run = run_job(
        compose(
            [
                *(o for o in REDUCED if not o.startswith("data.num_samples=")),
                "data.num_samples=32",
                "extract=vllm",
                "hardware.vllm.data_parallel=2",
                "run.stages=[prepare,extract]",
                f"run.output_root={two}",
            ]
        )
    )
    killer.join(timeout=5)
    assert killed, "the second server was never seen writing"
    one, both = runs["vllm"].results["extract"], run.results["extract"]
    m = both.metrics
    names = sorted(p.name for p in (both.path / "hidden_states").iterdir())
    assert len(names) == m["samples"] == 32
    assert set(names) <= {p.name for p in (one.path / "hidden_states").iterdir()}
    worst = 0.0
    for name in names:
        a = load_file(str(one.path / "hidden_states" / name))
        b = load_file(str(both.path / "hidden_states" / name))
        assert torch.equal(a["token_ids"], b["token_ids"]), name
        d, n = _rel(b["hidden_states"].float(), a["hidden_states"].float())
        worst = max(worst, (d / n) ** 0.5)
    assert worst < 0.02, worst
    shares = json.loads((both.path / "servers.json").read_text())
    print(f"two servers, one killed: {shares}; worst relative difference {worst:.4f}")
    assert [s["dropped"] for s in shares] == [False, True] and m["servers_dropped"] == 1
    assert shares[0]["rows"] + shares[1]["rows"] == m["samples"] - 1  # sample 0 went first
    assert shares[0]["rows"] > shares[1]["rows"] >= 1
    assert not servers_under(two)


# -- online training (extract.mode=online) and a server that already runs -----------------------


# Online and offline training compared over their first ONLINE_STEPS steps, each a run of that
# length (the learning-rate schedule spans the run): the whole epoch online took 313 s here, 2.8x
# offline's, with the server's forward on one of the two cores.
ONLINE_STEPS = 12


def _losses(run) -> dict[int, float]:
    lines = (run.results["train"].path / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["train/loss"] for r in map(json.loads, lines) if "train/loss" in r}


@pytest.fixture(scope="module")
def online_run(runs, root):
    """The same rows and settings as the offline run, trained online against a vLLM server, and
    trained offline from the stored states for as many steps."""
    short = [*REDUCED, f"train.max_steps={ONLINE_STEPS}", "train.log_freq=1"]
    short += [f"run.output_root={root}", "run.stages=[prepare,extract,vocab,train]"]
    offline = run_job(compose([*short, "extract=vllm", "run.name=offline-short"]))
    online = run_job(compose([*short, "extract=online", "run.name=online"]))
    return online, offline


def test_online_training_stores_nothing_and_trains_as_offline_does(runs, online_run, root):
    online, offline = online_run
    ext = online.results["extract"]
    assert not (ext.path / "hidden_states").exists() and ext.metrics["bytes"] == 0
    served = json.loads((ext.path / "served.json").read_text())
    assert served["capture_ids"] == [2, 15, 27, 30] and served["vllm"] != "absent"
    assert "extract_hidden_states" in " ".join(served["server_args"])
    train = online.results["train"]
    manifest = json.loads((train.path / "manifest.json").read_text())
    assert "vllm_endpoint" in manifest["speculators_settings"]
    assert manifest["served"]["probe_shape"][1] == 4
    # speculators deletes each fetched file once loaded: nothing piles up while training.
    assert not list((root / "scratch").glob("train-*/online_states/*.safetensors"))
    # Offline trained on the shared run's stored states (its extraction was reused).
    assert offline.results["extract"].path == runs["vllm"].results["extract"].path
    t_off = offline.results["train"].metrics["seconds_per_epoch"]
    t_on = train.metrics["seconds_per_epoch"]
    on, off = _losses(online), _losses(offline)
    worst = max(abs(on[k] - off[k]) / off[k] for k in off)
    print(
        f"{ONLINE_STEPS} steps, online vs offline: worst relative loss difference {worst:.2e}; "
        f"seconds offline {t_off:.1f}, online {t_on:.1f} ({t_on / t_off:.2f}x), online server "
        f"start {train.metrics['server_start_s']:.1f} s"
    )
    # The same vLLM states, fetched rather than read, the same rows in the same order: the same
    # training, step by step (equal to the last bit here; 1% leaves room for bf16 batching noise,
    # while states of another layer or row move the loss by far more within a few steps). The
    # draft it makes is then the offline one, whose served acceptance the tests above measure.
    assert sorted(on) == sorted(off) == list(range(ONLINE_STEPS))
    assert worst <= 0.01, worst


@pytest.fixture(scope="module")
def existing_server(online_run, root):
    """A vLLM server started by the test with the flags the online record says it needs, with
    its engine config readable (VLLM_SERVER_DEV_MODE=1), as a user would start it on a serving
    box."""
    from runner.serving.vllm_server import VllmServer

    served = json.loads((online_run[0].results["extract"].path / "served.json").read_text())
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
    from runner.core.errors import ConfigError

    base = [*REDUCED, f"run.output_root={root}", f"hardware.vllm.endpoint={existing_server}"]
    up_to_train = ["extract=online", "run.stages=[prepare,extract,vocab,train]"]
    # Refused in the plan, naming the setting: longer rows than the server takes ...
    with pytest.raises(ConfigError) as info:
        run_job(compose([*base, *up_to_train, "data.max_seq_len=1024", "run.plan_only=true"]))
    assert info.value.key == "data.max_seq_len"
    # ... an evaluation against a server that extracts (it serves no draft) ...
    with pytest.raises(ConfigError) as info:
        # (the draft trained on vLLM's states is in the store)
        run_job(compose([*base, "extract=vllm", "run.stages=[evaluate]", "run.plan_only=true"]))
    assert info.value.key == "hardware.vllm.endpoint"
    assert "extract_hidden_states" in info.value.message
    # ... and a dtype it does not run in.
    with pytest.raises(ConfigError) as info:
        run_job(compose([*base, *up_to_train, "hardware.dtype=float16", "run.plan_only=true"]))
    assert info.value.key == "hardware.dtype"
    # Online training against it (a new seed: a new draft), and an offline extraction through it.
    # 24 rows: what is tested is the path through the endpoint, not the draft (CI's time).
    trained = run_job(
        compose(
            [
                *base,
                *up_to_train,
                "data.num_samples=24",
                "train.seed=1",
                "run.name=endpoint-online",
            ]
        )
    )
    served = json.loads((trained.results["train"].path / "manifest.json").read_text())["served"]
    assert served["endpoint"] == existing_server and served["server_args"] is None
    assert trained.results["train"].metrics["steps"] > 0
    offline = ["extract=vllm", "data.num_samples=16", "run.stages=[prepare,extract]"]
    extracted = run_job(compose([*base, *offline, "run.name=endpoint-offline"]))
    files = list((extracted.results["extract"].path / "hidden_states").glob("hs_*.safetensors"))
    assert len(files) == extracted.results["extract"].metrics["samples"] == 16
    assert not list(root.glob("endpoint_states/*.safetensors")), "files moved, none left behind"
    # Several servers, one of them down: the plan warns, the live one extracts every row.
    from runner.serving.vllm_server import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    listed = [
        *base,
        "extract=vllm",
        "data.num_samples=12",
        "run.stages=[prepare,extract]",
        f"hardware.vllm.endpoints=[{dead},{existing_server}]",
        "hardware.vllm.endpoint=null",
    ]
    planned = run_job(compose([*listed, "run.plan_only=true"])).plan
    assert "hardware.vllm.endpoints[0]" in planned.render() and not planned.errors
    ext = run_job(compose(listed)).results["extract"]
    assert len(list((ext.path / "hidden_states").glob("hs_*.safetensors"))) == 12
