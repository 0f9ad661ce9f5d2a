"""The `vllm` backend of stage `extract`: hidden states from a vLLM server the runner starts.

Selected with `python -m runner extract=vllm` (or `extract.backend=vllm`). The server runs the
target with the `extract_hidden_states` speculative method (capture ids in vLLM's convention,
final layer before the norm included) and vLLM's hidden-states connector, which writes one
safetensors file per request; on CPU the connector is `runner.integrations.vllm_cpu_connector`.
Requests are
sent by speculators' own data-generation client (`speculators generate-offline-data` as a
function: its request loop, retries, lock waits and moves), one per prepared row, from this
process or, with `extract.clients` above 1, from that many processes each over its share of the
rows (stages/extract/client_shard.py: one Python client sends about 100 requests a second at
most). The files are `hs_{i}.safetensors` with `hidden_states` [seq, slots, hidden] and `token_ids`,
exactly what the transformers backend writes.

Resume: files land in the stage's scratch folder, which survives a failed or interrupted run;
the next run skips samples whose files are readable and redoes unreadable ones (speculators'
check). Once every row has a valid file they are moved into the artifact.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runner.errors import StageError
from runner.integrations.speculators import recording_skips
from runner.process import ManagedProcess
from runner.schema import RunnerConfig
from runner.stage import StageContext
from runner.store import fmt_bytes
from runner.target_facts import ModelFacts
from runner.vllm_server import ExistingServer, VllmServer, engine_args, quiet_http_logs, serve
from stages.extract import final_slot
from stages.extract.samples import LayerStats, write_sample

log = logging.getLogger("runner")
CPU_CONNECTOR_MODULE = "runner.integrations.vllm_cpu_connector"


def server_args(cfg: RunnerConfig, facts: ModelFacts, staging: Path) -> list[str]:
    """Flags for an extraction server, all derived from the composed config."""
    cpu = cfg.hardware.device == "cpu"
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": list(facts.extract_ids)}
        },
    }
    kv = {
        "kv_connector": "CpuHiddenStatesConnector" if cpu else "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(staging)},
    }
    if cpu:
        kv["kv_connector_module_path"] = CPU_CONNECTOR_MODULE
    step = cfg.extract_batch_tokens()  # extract.batch_tokens; None: vLLM's default
    batch = ["--max-num-batched-tokens", str(step)] if step else []
    # Each prepared row plus the one generated token.
    return [
        *engine_args(cfg, cfg.data.max_seq_len + 1),
        *batch,
        # Both corrupt captured states in some vLLM versions (speculators #279, #283, #994).
        "--no-enable-chunked-prefill",
        "--no-enable-prefix-caching",
        "--speculative-config",
        json.dumps(spec),
        "--kv-transfer-config",
        json.dumps(kv),
    ]


class ClientExit(Exception):
    """speculators' client stopped with exit `code` (130: interrupted); `failed`: the samples it
    had given up on by then, with the reason."""

    def __init__(self, code: int | str | None, failed: dict[int, str]):
        super().__init__(f"exit {code}")
        self.code, self.failed = code, failed


def client_pass(
    url: str,
    model: str,
    requests_dir: Path,
    out_dir: Path,
    *,
    concurrency: int,
    request_timeout_s: float,
    max_retries: int,
    max_samples: int | None = None,
    world: int = 1,
    rank: int = 0,
) -> dict[int, str]:
    """speculators' data-generation client over share `rank` of `world` of the rows (its own
    split); the samples it gave up on. Raises ClientExit if the client stops."""
    # speculators takes seconds to import: only when a stage runs (the train stage and the plan
    # import this module for `server_args`, and every command line would pay it).
    from speculators.cli.generate_offline_data import generate_offline_data

    with recording_skips() as rec, quiet_http_logs():
        try:
            generate_offline_data(
                model=model,
                endpoint=url,
                preprocessed_data=str(requests_dir),
                output=str(out_dir),
                max_samples=max_samples,
                concurrency=concurrency,
                # Every file is read and checked once afterwards (with the statistics); the
                # client's own check would read each a second time.
                validate_outputs=False,
                request_timeout=request_timeout_s,
                max_retries=max_retries,
                fail_on_error=False,
                # Isolated failures are collected and reported by sample; this many in a row
                # (after retries) means the server is gone, and the client stops instead of
                # retrying every remaining sample against it.
                max_consecutive_errors=2 * concurrency,
                world_size=world,
                rank=rank,
            )
        except SystemExit as exc:
            raise ClientExit(exc.code, rec.failed) from None
    return rec.failed


def _run_client(
    server: VllmServer | ExistingServer,
    requests_dir: Path,
    out_dir: Path,
    cfg: RunnerConfig,
    max_samples: int | None,
    concurrency: int | None = None,
    clients: int | None = None,
    logs: Path | None = None,
) -> dict[int, str]:
    """speculators' data-generation client against the server, in this process or (with
    extract.clients above 1) in that many processes, each over its share of the rows; the
    samples they gave up on."""
    e = cfg.extract
    concurrency = concurrency or e.concurrency
    # A probe of a few samples needs no more than one client.
    clients = 1 if max_samples is not None else (clients or cfg.extract_clients())
    try:
        if clients == 1:
            return client_pass(
                server.url,
                str(server.model_id),
                requests_dir,
                out_dir,
                concurrency=concurrency,
                request_timeout_s=e.request_timeout_s,
                max_retries=e.max_retries,
                max_samples=max_samples,
            )
        return _client_processes(
            server, requests_dir, out_dir, cfg, concurrency, clients, logs or out_dir.parent
        )
    except ClientExit as exc:
        if exc.code == 130:
            raise KeyboardInterrupt from None
        server.check_alive()  # a dead server is the reason: say so, with its log
        if exc.failed:
            raise StageError(_failed_samples(exc.failed, cfg, out_dir)) from None
        raise StageError(
            f"speculators' data-generation client failed (exit {exc.code}); see the log "
            f"above and {server.log_path}"
        ) from None


def _worth_echoing(line: str) -> bool:
    # A client process's progress stays in its log; its warnings (retries, skipped samples) and
    # errors are printed too.
    return any(word in line for word in ("WARNING", "ERROR", "Traceback", "Error"))


def _client_processes(
    server: VllmServer | ExistingServer,
    requests_dir: Path,
    out_dir: Path,
    cfg: RunnerConfig,
    concurrency: int,
    clients: int,
    logs: Path,
) -> dict[int, str]:
    """`clients` client processes (stages/extract/client_shard.py), each over its share of the
    rows with its part of the requests in flight; waits for all, logging progress."""
    import datasets

    total = len(datasets.load_from_disk(str(requests_dir)))
    e = cfg.extract
    per = -(-concurrency // clients)
    root = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
        "TQDM_DISABLE": "1",  # progress is logged here, from the files written
    }
    logs.mkdir(parents=True, exist_ok=True)
    failed: dict[int, str] = {}
    log.info(
        "[extract] %d client processes, %d requests in flight each (extract.clients, "
        "extract.concurrency); their logs: %s",
        clients,
        per,
        logs / "client_*.log",
    )
    with contextlib.ExitStack() as stack:
        pending: dict[int, tuple[ManagedProcess, Path]] = {}
        for rank in range(clients):
            result = logs / f"client_{rank}.json"
            result.unlink(missing_ok=True)
            spec = {
                "url": server.url,
                "model": str(server.model_id),
                "requests": str(requests_dir),
                "out": str(out_dir),
                "concurrency": per,
                "request_timeout_s": e.request_timeout_s,
                "max_retries": e.max_retries,
                "world": clients,
                "rank": rank,
                "result": str(result),
            }
            proc = ManagedProcess(
                [sys.executable, "-m", "stages.extract.client_shard", json.dumps(spec)],
                env,
                logs / f"client_{rank}.log",
                label=f"extract:client {rank}",
                cwd=Path(root),
                echo=_worth_echoing,
            )
            stack.enter_context(proc)
            pending[rank] = (proc, result)
        t0 = shown = time.time()
        while pending:
            for rank, (proc, result) in list(pending.items()):
                code = proc.exited()
                if code is None:
                    continue
                del pending[rank]
                got = json.loads(result.read_text()) if result.exists() else {"failed": {}}
                failed.update({int(k): v for k, v in got["failed"].items()})
                if code != 0:
                    log.warning("[extract] client %d exited %s; %s", rank, code, proc.tail_text(5))
                    raise ClientExit(code, failed)
            if time.time() - shown >= 30:
                shown = time.time()
                done = sum(1 for _ in out_dir.glob("hs_*.safetensors"))
                log.info(
                    "[extract] %d of %d sample files written (%.0f s)", done, total, shown - t0
                )
            time.sleep(0.2)
    return failed


def _failed_samples(why: dict[int, str], cfg: RunnerConfig, done_dir: Path) -> str:
    shown = sorted(why)[:10]
    more = " ..." if len(why) > len(shown) else ""
    reasons = "; ".join(f"sample {i}: {why[i]}" for i in shown[:3])
    return (
        f"vLLM extraction failed for sample{'s' if len(why) > 1 else ''} "
        f"{', '.join(map(str, shown))}{more} ({len(why)} in all) after "
        f"{cfg.extract.max_retries} retries each (extract.max_retries); {reasons}. Files written "
        f"so far stay in {done_dir}; a re-run redoes only the missing samples."
    )


def extract(
    ctx: StageContext, rows: Sequence[Any], out_dir: Path, stats: LayerStats
) -> dict[str, Any]:
    import datasets
    import torch
    from safetensors.torch import load_file
    from speculators.data_generation.offline import (
        check_hidden_states,
        find_corrupt_hidden_state_indices,
        get_existing_hidden_state_indices,
    )

    cfg, facts = ctx.cfg, ctx.facts
    e = cfg.extract
    scratch: Path = ctx.scratch
    done_dir = scratch / "hidden_states"  # survives failures: the next run resumes from it
    staging = (
        scratch / "vllm_staging"
    )  # where the connector writes; same filesystem, so moves are renames
    requests_dir = scratch / "requests"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(requests_dir, ignore_errors=True)
    for d in (done_dir, staging):
        d.mkdir(parents=True, exist_ok=True)
    present = get_existing_hidden_state_indices(done_dir)
    unreadable = find_corrupt_hidden_state_indices(done_dir, present)
    before = {f"hs_{i}.safetensors" for i in present if i not in unreadable}
    if present:
        log.info(
            "[extract] resuming from %s: %d readable sample files kept, %d unreadable ones redone",
            done_dir,
            len(before),
            len(unreadable),
        )

    datasets.Dataset.from_dict({"input_ids": [r.tolist() for r in rows]}).with_format(
        "torch"
    ).save_to_disk(str(requests_dir))
    # The log lives in scratch while the server runs (kept there if the stage fails), then in
    # the artifact.
    log_path = scratch / "logs" / "vllm_extract.log"
    # hardware.vllm.endpoint: a server that already runs, checked by the plan; it writes where
    # it was told to (its own --kv-transfer-config), and the client moves the files here.
    server = serve(cfg, facts.path, server_args(cfg, facts, staging), log_path, label="extract")
    with server:
        # One sample first: a server that writes the wrong slots fails here, not after every row.
        failed = _run_client(server, requests_dir, done_dir, cfg, max_samples=1)
        first = done_dir / "hs_0.safetensors"
        if failed or not first.exists():
            server.check_alive()
            raise StageError(_failed_samples(failed or {0: "no file written"}, cfg, done_dir))
        states = load_file(str(first))["hidden_states"]
        got = states.shape
        want = (len(rows[0]), len(facts.extract_ids))
        if tuple(got[:2]) != want:
            raise StageError(
                f"vLLM wrote hidden states of shape {tuple(got)} for sample 0; expected "
                f"[{want[0]}, {want[1]}, hidden] for capture ids {list(facts.extract_ids)}"
            )
        # The last slot must be the pre-norm final state: the target's own norm and head on it
        # reproduce the server's next tokens (only those two tensors are read from disk).
        top1 = final_slot.prompt_top1(server, rows[0].tolist(), e.request_timeout_s)
        selftest = final_slot.check(
            facts.path, states[:, -1], top1, final_slot.norm_eps(facts.path), facts.num_layers
        )
        log.info(
            "[extract] final-slot self-test passed: %.1f%% of %d decisive positions agree; "
            "read %s in %.1f s",
            100 * selftest["selftest_next_token_agreement"],
            selftest["selftest_positions"],
            fmt_bytes(selftest["selftest_bytes_read"]),
            selftest["selftest_s"],
        )
        t0 = time.time()
        failed = _run_client(
            server, requests_dir, done_dir, cfg, max_samples=None, logs=log_path.parent
        )
        seconds = time.time() - t0
        server.check_alive()
        start_s = server.start_s
    missing = [i for i in range(len(rows)) if not (done_dir / f"hs_{i}.safetensors").exists()]
    bad = find_corrupt_hidden_state_indices(done_dir, list(range(len(rows))))
    if missing or bad:
        raise StageError(
            _failed_samples(
                {**{i: failed.get(i, "no file") for i in missing}, **bad}, cfg, done_dir
            )
        )
    # Validate and summarise every file (token ids, length, finite values, slot count), then
    # publish.
    t_check = time.time()
    for i, ids in enumerate(rows):
        path = done_dir / f"hs_{i}.safetensors"
        data = load_file(str(path))
        try:
            check_hidden_states(data, ids.tolist())
        except ValueError as exc:
            path.unlink()
            raise StageError(
                f"vLLM hidden states for sample {i} are invalid ({exc}); the file was removed, "
                "a re-run redoes it"
            ) from None
        hs = data["hidden_states"]
        if hs.shape[1] != len(facts.extract_ids) or hs.dtype != getattr(torch, cfg.hardware.dtype):
            raise StageError(
                f"vLLM hidden states for sample {i} have shape {tuple(hs.shape)} {hs.dtype}; "
                "expected "
                f"{len(facts.extract_ids)} slots in {cfg.hardware.dtype}"
            )
        stats.update_batch(hs[None], [hs.shape[0]])
    fp8 = cfg.extract.storage == "fp8"
    for i, ids in enumerate(rows):
        src, dst = done_dir / f"hs_{i}.safetensors", out_dir / f"hs_{i}.safetensors"
        if fp8:  # quantized after the statistics above saw the full-precision values
            write_sample(dst, load_file(str(src))["hidden_states"], ids, "fp8")
            src.unlink()
        else:
            shutil.move(src, dst)
    if log_path.parent.is_dir():  # none with an existing server: its log is on its machine
        shutil.copytree(log_path.parent, ctx.out / "logs")
    # Throughput over the rows the main pass computed (not sample 0's probe, not resumed files).
    fresh = sum(len(r) for i, r in enumerate(rows) if i > 0 and f"hs_{i}.safetensors" not in before)
    return {
        "tokens": float(sum(len(r) for r in rows)),
        "seconds": seconds,
        "tokens_per_s": fresh / seconds if seconds > 0 else float("nan"),
        "server_start_s": start_s,
        # Reading, checking and summarising every file after the client (not in tokens_per_s).
        "check_s": time.time() - t_check,
        "concurrency": float(cfg.extract.concurrency),
        "clients": float(cfg.extract_clients()),
        **selftest,
        "resumed_samples": len(before),
        "redone_unreadable": len(unreadable),
    }
