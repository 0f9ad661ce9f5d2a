"""Hidden states from a vLLM extraction server, one request per row: the request loop of the
`vllm` extract backend, in place of speculators' data-generation client.

    failed = fetch_rows(url, model, {i: ids, ...}, out_dir, concurrency=8, timeout_s=600,
                        retries=3)     # -> {row: reason} for the rows it gave up on

It speaks the protocol speculators' client speaks (vLLM's hidden-states connector): a completion
of `max_tokens` 1 with `return_token_ids`, whose `kv_transfer_params.hidden_states_path` names the
file the server writes, with a companion `.lock` held until the file is complete; the file is
then moved to `out_dir/hs_{row}.safetensors`. Like that client it retries each request with
backoff, checks that the server saw the row's own token ids, skips a row that keeps failing and
stops once `2 x concurrency` rows in a row failed (the server is gone).

Why not speculators' client: on one H200 it spent 16 ms of CPU per row (9 ms with larger server
steps), almost all in the OpenAI client library preparing each request (its type-driven
transform visits every prompt token id), so one process sent at most 60 to 110 rows a second and
extraction ran at 0.40x to 0.72x the in-process rate, the client busy 100% of the time
(benchmarks/vllm_extract_bench.py, docs/benchmarks.md). Several client processes did worse: each
imports speculators and torch (about 20 s of CPU) before its first request. Here a request is a
JSON body sent by aiohttp and the lock wait is a blocking flock in a thread, not a 0.1 s poll.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import fcntl
import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

# Seconds before retry n (1-based): 2, 4, 8, ... as speculators' client waits.
_BACKOFF_BASE = 2


class ServerGone(Exception):
    """Too many rows in a row failed: the server stopped answering."""

    def __init__(self, failed: dict[int, str]):
        super().__init__(f"{len(failed)} rows failed")
        self.failed = failed


class _Invalid(Exception):
    """An answer that retrying cannot fix (the wrong prompt, no file named)."""


def _wait_and_move(path: str, dest: Path) -> None:
    """Wait until the server has written `path` (its .lock released), then move it to `dest`."""
    lock = path + ".lock"
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:  # written and released before we looked
        fd = None
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # sleeps until the writer's exclusive lock is gone
        finally:
            os.close(fd)
        os.unlink(lock)
    shutil.move(path, dest)


async def _request(
    session: object, url: str, body: bytes, ids: Sequence[int], timeout_s: float
) -> str:
    import aiohttp

    assert isinstance(session, aiohttp.ClientSession)
    async with session.post(
        f"{url}/completions",
        data=body,
        headers={"Content-Type": "application/json"},
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    ) as r:
        text = await r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {text[:400].decode(errors='replace')}")
    answer = json.loads(text)
    if answer["choices"][0].get("prompt_token_ids") != list(ids):
        raise _Invalid("the server's prompt token ids differ from the row's")
    path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
    if not path:
        raise _Invalid(
            "the answer names no hidden_states_path (kv_transfer_params): is the server's "
            "--kv-transfer-config the hidden-states connector?"
        )
    return str(path)


async def _fetch(
    url: str,
    model: str,
    rows: Mapping[int, Sequence[int]],
    out_dir: Path,
    concurrency: int,
    timeout_s: float,
    retries: int,
    done: Callable[[int], None],
) -> dict[int, str]:
    import aiohttp

    failed: dict[int, str] = {}
    streak = [0]  # rows failed in a row
    todo = iter(sorted(rows))
    # Lock waits block: a thread per request in flight, never starved by the default pool's size.
    files = concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="hs-move")
    loop = asyncio.get_running_loop()

    async def one(session: aiohttp.ClientSession, row: int) -> None:
        ids = [int(t) for t in rows[row]]
        body = json.dumps(
            {"model": model, "prompt": ids, "max_tokens": 1, "return_token_ids": True}
        ).encode()
        why = ""
        for attempt in range(retries + 1):
            if attempt:
                await asyncio.sleep(_BACKOFF_BASE**attempt)
            try:
                path = await _request(session, url, body, ids, timeout_s)
                await loop.run_in_executor(
                    files, _wait_and_move, path, out_dir / f"hs_{row}.safetensors"
                )
            except _Invalid as exc:
                why = str(exc)
                break
            except (aiohttp.ClientError, TimeoutError, RuntimeError, OSError) as exc:
                why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                continue
            streak[0] = 0
            done(row)
            return
        failed[row] = why
        streak[0] += 1
        if streak[0] >= 2 * concurrency:
            raise ServerGone(failed)

    async def worker(session: aiohttp.ClientSession) -> None:
        for row in todo:  # one iterator shared by every worker: each row is taken once
            await one(session, row)

    connector = aiohttp.TCPConnector(limit=concurrency)
    try:
        async with aiohttp.ClientSession(connector=connector) as session:
            tasks = [asyncio.create_task(worker(session)) for _ in range(concurrency)]
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        # A lock is held only while the server writes a file: nothing here waits long.
        files.shutdown(wait=False, cancel_futures=True)
    return failed


def fetch_rows(
    url: str,
    model: str,
    rows: Mapping[int, Sequence[int]],
    out_dir: Path,
    *,
    concurrency: int,
    timeout_s: float,
    retries: int,
    done: Callable[[int], None] = lambda _row: None,
) -> dict[int, str]:
    """Request every row of `rows` ({row: token ids}) from the server at `url` (".../v1") with
    `concurrency` in flight, each file moved to out_dir/hs_{row}.safetensors; `done(row)` after
    each. Returns {row: reason} for the rows given up on after `retries` retries each; raises
    ServerGone once 2 x concurrency rows in a row failed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return asyncio.run(
        _fetch(url.rstrip("/"), model, rows, out_dir, concurrency, timeout_s, retries, done)
    )
