"""The `vllm` backend of stage `extract`: hidden states from a vLLM server the runner starts.

Selected with `python -m runner extract=vllm` (or `extract.backend=vllm`). The server runs the
target with the `extract_hidden_states` speculative method (capture ids in vLLM's convention,
final layer before the norm included) and vLLM's hidden-states connector, which writes one
safetensors file per request; on CPU the connector is `runner.integrations.vllm_cpu_connector`.
Requests go out one per prepared row from the runner's own request loop (runner/integrations/
vllm_hidden_states_client.py; speculators' data-generation client speaks the same protocol but
spends 9 to 16 ms of CPU a row, which capped extraction on a GPU). The files are
`hs_{i}.safetensors` with `hidden_states` [seq, slots, hidden] and `token_ids`, exactly what the
transformers backend writes.

Resume: files land in the stage's scratch folder, which survives a failed or interrupted run;
the next run skips samples whose files are readable and redoes unreadable ones (speculators'
check). Each file is read, checked and summarised as soon as it lands, while the other requests
are out (stages/extract/file_check.py). Once every row has a valid file they are moved into the
artifact.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from runner.assets.target_facts import ModelFacts
from runner.core.errors import StageError
from runner.core.schema import RunnerConfig
from runner.core.store import fmt_bytes
from runner.engine.console import bar_interval
from runner.engine.stage import StageContext
from runner.integrations.vllm_hidden_states_client import Fetched, Server, ServerGone, fetch_rows
from runner.serving.hidden_states import server_args
from runner.serving.server_pool import answers, serve_pool
from runner.serving.vllm_server import ExistingServer, VllmServer
from stages.extract import final_slot
from stages.extract.file_check import FileCheck
from stages.extract.samples import LayerStats
from stages.extract.settings import concurrency as extract_concurrency

log = logging.getLogger("runner")


def fetch(
    servers: VllmServer | ExistingServer | Sequence[VllmServer | ExistingServer],
    rows: dict[int, Sequence[int]],
    out_dir: Path,
    cfg: RunnerConfig,
    concurrency: int | None = None,
    landed: Callable[[int], None] = lambda _row: None,
) -> Fetched:
    """The hidden states of `rows` ({row: token ids}) from the servers into out_dir, with
    extract.concurrency requests in flight on each (runner/integrations/
    vllm_hidden_states_client.py); the rows given up on, with the reason, and each server's
    share; `landed(row)` as each row's file arrives. A server that stops answering is left out
    (its rows go to the others); when none is left the stage ends."""
    from tqdm import tqdm

    pool = list(servers) if isinstance(servers, Sequence) else [servers]
    e = cfg.extract
    bar = tqdm(
        total=len(rows),
        desc="extract",
        unit="row",
        disable=len(rows) < 2,
        mininterval=bar_interval(),
    )

    def dropped(s: Server) -> None:
        if len(pool) > 1:
            log.warning(
                "[extract] the server at %s stopped answering; the other servers take its rows",
                s.url,
            )

    try:
        return fetch_rows(
            [Server(s.url, str(s.model_id), partial(answers, s)) for s in pool],
            rows,
            out_dir,
            concurrency=concurrency or extract_concurrency(cfg),
            timeout_s=e.request_timeout_s,
            retries=e.max_retries,
            done=lambda row: (landed(row), bar.update(1)),
            dropped=dropped,
        )
    except ServerGone as exc:
        for s in pool:
            s.check_alive(settle_s=20)  # a dead server is the reason: say so, with its log
        logs = ", ".join(str(s.log_path) for s in pool)
        raise StageError(
            _failed_samples(exc.failed, cfg, out_dir) + f"; the server stopped answering (its "
            f"log: {logs})"
        ) from None
    finally:
        bar.close()


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


def _resumed(done_dir: Path) -> tuple[set[str], list[int]]:
    """The sample files an earlier attempt left in done_dir that read back (kept: their rows are
    not requested again), and the indices of those that do not (removed: requested again)."""
    from speculators.data_generation.offline import (
        find_corrupt_hidden_state_indices,
        get_existing_hidden_state_indices,
    )

    present = get_existing_hidden_state_indices(done_dir)
    unreadable = find_corrupt_hidden_state_indices(done_dir, present)
    for i in unreadable:  # an interrupted move or a damaged file: requested again
        (done_dir / f"hs_{i}.safetensors").unlink()
    before = {f"hs_{i}.safetensors" for i in present if i not in unreadable}
    if present:
        log.info(
            "[extract] resuming from %s: %d readable sample files kept, %d unreadable ones redone",
            done_dir,
            len(before),
            len(unreadable),
        )
    return before, list(unreadable)


def _record_shares(out: Path, shares: list[dict[str, Any]], servers: int) -> None:
    """Each server's share, in servers.json and on the console, where there were several."""
    if servers <= 1 and len(shares) <= 1:
        return
    (out / "servers.json").write_text(json.dumps(shares, indent=1))
    for k, sh in enumerate(shares):
        log.info(
            "[extract] server %d (%s): %d rows, %.0f tok/s%s",
            k,
            sh["url"],
            sh["rows"],
            sh["tokens_per_s"],
            ", stopped answering and was left out" if sh["dropped"] else "",
        )


def extract(
    ctx: StageContext, rows: Sequence[Any], out_dir: Path, stats: LayerStats
) -> dict[str, Any]:
    import torch

    cfg, facts = ctx.cfg, ctx.facts
    scratch: Path = ctx.scratch
    done_dir = scratch / "hidden_states"  # survives failures: the next run resumes from it
    # Where the connector writes; the same filesystem, so moves are renames.
    staging = scratch / "vllm_staging"
    shutil.rmtree(staging, ignore_errors=True)
    for d in (done_dir, staging):
        d.mkdir(parents=True, exist_ok=True)
    before, unreadable = _resumed(done_dir)
    # The logs live in scratch while the servers run (kept there if the stage fails), then in
    # the artifact. hardware.vllm.endpoint(s): servers that already run, checked by the plan;
    # each writes where it was told to (its own --kv-transfer-config), the client moves the
    # files here. hardware.vllm.data_parallel: several started here, each with its own staging
    # folder (the files' names come from the request, which can repeat across servers).
    logs = scratch / "logs"

    def args_for(k: int) -> list[str]:
        return server_args(cfg, facts, staging / f"s{k}" if k else staging)

    # Each file is read, checked and summarised as it lands (stages/extract/file_check.py).
    fp8 = cfg.extract.storage == "fp8"
    dtype = getattr(torch, cfg.hardware.dtype)
    check = FileCheck(
        rows, done_dir, stats, len(facts.extract_ids), dtype, out_dir if fp8 else None
    )
    try:
        servers, fetched, selftest, seconds = _request_all(
            cfg, facts, rows, done_dir, args_for, logs, check
        )
    except BaseException:
        check.close()
        raise
    failed = fetched.failed
    start_s = max(s.start_s or 0.0 for s in servers)
    waited_s = check.finish()
    if check.error:  # a bad file, named (and removed: a re-run requests it again)
        raise StageError(check.error)
    if check.checked < len(rows):  # the check stopped at a row whose file never came
        missing = [i for i in range(len(rows)) if not (done_dir / f"hs_{i}.safetensors").exists()]
        raise StageError(
            _failed_samples({i: failed.get(i, "no file") for i in missing}, cfg, done_dir)
        )
    # Every file checked; publish (fp8: the quantized copies are in the artifact already).
    for i in range(len(rows)):
        src = done_dir / f"hs_{i}.safetensors"
        if fp8:
            src.unlink()
        else:
            shutil.move(src, out_dir / src.name)
    if logs.is_dir():  # none with existing servers: their logs are on their machines
        shutil.copytree(logs, ctx.out / "logs")
    shares = _shares(fetched, seconds, servers)
    _record_shares(ctx.out, shares, len(servers))
    # Throughput over the rows the main pass computed (not sample 0's probe, not resumed files).
    fresh = sum(len(r) for i, r in enumerate(rows) if i > 0 and f"hs_{i}.safetensors" not in before)
    return {
        "tokens": float(sum(len(r) for r in rows)),
        "seconds": seconds,
        "tokens_per_s": fresh / seconds if seconds > 0 else float("nan"),
        "server_start_s": start_s,
        # Reading, checking and summarising the files: the part left after the client (not in
        # tokens_per_s), and the whole of it, mostly while the requests were out.
        "check_s": waited_s,
        "check_busy_s": check.busy_s,
        "concurrency": float(extract_concurrency(cfg)),
        "servers": float(len(servers)),
        "servers_dropped": float(sum(sh["dropped"] for sh in shares)),
        # Each server's own share (the manifest's metrics are flat numbers; servers.json holds
        # the same with the addresses).
        **{f"server{k}_rows": float(sh["rows"]) for k, sh in enumerate(shares)},
        **{f"server{k}_tokens_per_s": sh["tokens_per_s"] for k, sh in enumerate(shares)},
        **selftest,
        "resumed_samples": len(before),
        "redone_unreadable": len(unreadable),
    }


def _request_all(
    cfg: RunnerConfig,
    facts: ModelFacts,
    rows: Sequence[Any],
    done_dir: Path,
    args_for: Callable[[int], list[str]],
    logs: Path,
    check: FileCheck,
) -> tuple[list[Any], Fetched, dict[str, Any], float]:
    """The servers up (serve_pool), sample 0 requested first and its slots and final state
    checked, then every row without a file; each file goes to `check` as it lands. Returns the
    servers, what the client fetched, the self-test's figures and the requests' seconds."""
    from safetensors.torch import load_file

    e = cfg.extract
    with serve_pool(cfg, facts.path, args_for, logs, label="extract") as servers:
        server = servers[0]
        # One sample first: a server that writes the wrong slots fails here, not after every row.
        first = done_dir / "hs_0.safetensors"
        failed = (
            {} if first.exists() else fetch(server, {0: rows[0].tolist()}, done_dir, cfg).failed
        )
        if failed or not first.exists():
            server.check_alive()
            raise StageError(_failed_samples(failed or {0: "no file written"}, cfg, done_dir))
        check.ready(0)
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
        todo = {
            i: r.tolist()
            for i, r in enumerate(rows)
            if not (done_dir / f"hs_{i}.safetensors").exists()
        }
        log.info(
            "[extract] requesting the hidden states of %d rows, %d in flight (extract.concurrency)"
            "%s",
            len(todo),
            extract_concurrency(cfg),
            f" on each of {len(servers)} servers" if len(servers) > 1 else "",
        )
        t0 = time.time()
        fetched = fetch(servers, todo, done_dir, cfg, landed=check.ready)
        seconds = time.time() - t0
        if not any(sh.dropped for sh in fetched.shares):
            for s in servers:
                s.check_alive()
    return servers, fetched, selftest, seconds


def _shares(
    fetched: Fetched, seconds: float, servers: Sequence[VllmServer | ExistingServer]
) -> list[dict[str, Any]]:
    """What each server did in the main pass: rows, tokens, tokens/s over the pass's time, its
    start-up seconds, and whether it was left out."""
    return [
        {
            "url": sh.url,
            "rows": sh.rows,
            "tokens": sh.tokens,
            "tokens_per_s": sh.tokens / seconds if seconds > 0 else float("nan"),
            "start_s": s.start_s,
            "dropped": sh.dropped,
        }
        for sh, s in zip(fetched.shares, servers, strict=True)
    ]
