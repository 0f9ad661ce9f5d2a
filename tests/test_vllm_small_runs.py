"""The vLLM lane's tests that need no trained draft of the lane (CI: `pytest -m vllm`), each on a
small run of its own: both regeneration backends answer alike, a request that keeps failing and
Ctrl-C while a server loads leave no server behind, and an online capture-layer sweep shares one
server.

They are apart from tests/test_vllm_backend.py so that xdist (--dist loadfile) runs them on the
other worker while that file's shared runs (two extractions, trainings, evaluations) take one.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from runner.core.errors import StageError
from tests.conftest import compose, run_job
from tests.vllm_lane import runner_until, servers_under

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm_small")


def test_regeneration_backends_give_the_same_greedy_answers(root):
    """The default target regenerates the same conversations greedily with vLLM and with
    transformers (first turns of 8 conversations, 32 tokens each): the same ids, or the
    difference reported and shown to be a bf16 near-tie."""
    base = [
        "data.num_samples=8",
        "regenerate.max_tokens=32",
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
    assert len(pairs) == 8
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
        f"identical over 32 tokens; the others part after {[p for p in prefixes if p < 32]} "
        f"tokens, each at a near-tie (fp32 logit gaps {[round(g, 3) for g in gaps]})"
    )
    assert all(g < 0.25 for g in gaps), gaps


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
    assert servers_under(root) == []


def test_ctrl_c_while_the_server_loads_stops_it(root):
    proc = runner_until(
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
    while servers_under(root) and time.time() < deadline:
        time.sleep(0.5)
    assert servers_under(root) == [], rest[-2000:]


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
            "data.num_samples=24",
            "train.epochs=1",
            # A few steps each: what is tested is one server for both jobs and each job's slots,
            # not the drafts (an epoch of 22 steps online took 46 s a job here, 2 minutes in CI).
            "train.max_steps=6",
            "eval.gates=warn",  # 6-step drafts serve near 1.0: the sharing is tested
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
    assert not servers_under(sweep), "the shared server ends with the sweep"
