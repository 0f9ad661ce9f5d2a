"""Hidden states from vLLM extraction servers, one request per row: the request loop of the
`vllm` extract backend, in place of speculators' data-generation client.

    got = fetch_rows([Server(url, model, alive), ...], {i: ids, ...}, out_dir, concurrency=8,
                     timeout_s=600, retries=3)
    got.failed   # {row: reason} for the rows it gave up on
    got.shares   # per server: rows, tokens, whether it stopped answering

It speaks the protocol speculators' client speaks (vLLM's hidden-states connector): a completion
of `max_tokens` 1 with `return_token_ids`, whose `kv_transfer_params.hidden_states_path` names the
file the server writes, with a companion `.lock` held until the file is complete; the file is
then moved to `out_dir/hs_{row}.safetensors`. Like that client it retries each request with
backoff, checks that the server saw the row's own token ids, skips a row that keeps failing and
stops once `2 x concurrency` rows in a row failed.

Several servers (data-parallel extraction, docs/multi-box.md) share one queue of rows,
`concurrency` requests in flight on each: a faster server simply takes more rows, and a row
whose request failed goes back on the queue for whichever server is free. A server that fails a
request and then does not answer `alive()` is dropped; its rows go to the others, and only when
no server is left does the fetch end (ServerGone). The files are the same whichever server wrote
them: one per row, named by the row.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Seconds before retry n (1-based): 2, 4, 8, ... as speculators' client waits.
_BACKOFF_BASE = 2


class ServerGone(Exception):
    """Too many rows in a row failed, or no server is left: extraction cannot go on."""

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
    http: object, url: str, body: bytes, ids: Sequence[int], timeout_s: float
) -> str:
    import aiohttp

    assert isinstance(http, aiohttp.ClientSession)
    async with http.post(
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


@dataclass
class Server:
    """One extraction server: its OpenAI base URL (".../v1"), its model id, and a check that it
    still answers (called after a failed request, in a thread)."""

    url: str
    model: str
    alive: Callable[[], bool] = lambda: True


@dataclass
class Share:
    """What one server did: rows and tokens written, and whether it was dropped."""

    url: str
    rows: int = 0
    tokens: int = 0
    dropped: bool = False


@dataclass
class Fetched:
    failed: dict[int, str] = field(default_factory=dict)
    shares: list[Share] = field(default_factory=list)


class _Fetch:
    """One fetch over `servers`: a queue of (row, failed attempts so far), `concurrency` workers
    a server taking rows from it, each file moved into `out_dir` by a thread of its own."""

    def __init__(
        self,
        servers: Sequence[Server],
        rows: Mapping[int, Sequence[int]],
        out_dir: Path,
        limits: tuple[int, float, int],
        done: Callable[[int], None],
        dropped: Callable[[Server], None],
    ) -> None:
        self.servers, self.rows, self.out_dir = servers, rows, out_dir
        self.concurrency, self.timeout_s, self.retries = limits
        self.done, self.dropped = done, dropped
        self.got = Fetched(shares=[Share(s.url.rstrip("/")) for s in servers])
        self.given_up = 0  # rows given up on in a row, over every server
        self.queue: asyncio.Queue[tuple[int, int] | None] = asyncio.Queue()
        for row in sorted(rows):
            self.queue.put_nowait((row, 0))
        self.pending = len(rows)
        self.workers = len(servers) * self.concurrency
        # Lock waits block: a thread per request in flight, never starved by the default pool.
        self.files = concurrent.futures.ThreadPoolExecutor(
            self.workers, thread_name_prefix="hs-move"
        )

    def finished(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            for _ in range(self.workers):  # wakes every worker waiting for a row: none is left
                self.queue.put_nowait(None)

    def give_up(self, row: int, why: str) -> None:
        self.got.failed[row] = why
        self.finished()
        self.given_up += 1
        if self.given_up >= 2 * self.concurrency:
            raise ServerGone(self.got.failed)

    async def one(self, http: Any, k: int, row: int, attempt: int) -> None:
        import aiohttp

        server, share = self.servers[k], self.got.shares[k]
        ids = [int(t) for t in self.rows[row]]
        body = json.dumps(
            {"model": server.model, "prompt": ids, "max_tokens": 1, "return_token_ids": True}
        ).encode()
        try:
            path = await _request(http, share.url, body, ids, self.timeout_s)
            await asyncio.get_running_loop().run_in_executor(
                self.files, _wait_and_move, path, self.out_dir / f"hs_{row}.safetensors"
            )
        except _Invalid as exc:
            self.give_up(row, str(exc))
            return
        except (aiohttp.ClientError, TimeoutError, RuntimeError, OSError) as exc:
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            await self.retry_or_give_up(k, row, attempt, why)
            return
        self.given_up = 0
        share.rows += 1
        share.tokens += len(ids)
        self.done(row)
        self.finished()

    async def retry_or_give_up(self, k: int, row: int, attempt: int, why: str) -> None:
        """A request that did not come back: the server may be gone (then the row goes to the
        others, not counted against it), or the row is tried again, or given up on."""
        server, share = self.servers[k], self.got.shares[k]
        loop = asyncio.get_running_loop()
        if not share.dropped and not await loop.run_in_executor(None, server.alive):
            share.dropped = True
            self.dropped(server)
        if share.dropped:
            self.queue.put_nowait((row, attempt))  # not the row's fault: not counted
        elif attempt >= self.retries:
            self.give_up(row, why)
        else:
            self.queue.put_nowait((row, attempt + 1))
            await asyncio.sleep(_BACKOFF_BASE ** (attempt + 1))  # this server waits
        if all(s.dropped for s in self.got.shares):
            while not self.queue.empty():
                item = self.queue.get_nowait()
                if item is not None:
                    self.got.failed[item[0]] = f"no server left ({why})"
            raise ServerGone(self.got.failed)

    async def worker(self, http: Any, k: int) -> None:
        while True:
            item = await self.queue.get()
            if item is None:
                return
            if self.got.shares[k].dropped:
                self.queue.put_nowait(item)  # for a server that still answers
                return
            await self.one(http, k, *item)

    async def run(self) -> Fetched:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=self.workers)
        try:
            async with aiohttp.ClientSession(connector=connector) as http:
                tasks = [
                    asyncio.create_task(self.worker(http, k))
                    for k in range(len(self.servers))
                    for _ in range(self.concurrency)
                ]
                try:
                    await asyncio.gather(*tasks)
                finally:
                    for t in tasks:
                        t.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            # A lock is held only while the server writes a file: nothing here waits long.
            self.files.shutdown(wait=False, cancel_futures=True)
        return self.got


def fetch_rows(
    servers: Sequence[Server],
    rows: Mapping[int, Sequence[int]],
    out_dir: Path,
    *,
    concurrency: int,
    timeout_s: float,
    retries: int,
    done: Callable[[int], None] = lambda _row: None,
    dropped: Callable[[Server], None] = lambda _server: None,
) -> Fetched:
    """Request every row of `rows` ({row: token ids}) from `servers`, `concurrency` in flight on
    each, each file moved to out_dir/hs_{row}.safetensors; `done(row)` after each, `dropped(s)`
    when a server stops answering (its rows go to the others). Returns the rows given up on
    after `retries` retries each, with the reason, and each server's share; raises ServerGone
    once 2 x concurrency rows in a row were given up on, or no server is left."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if not rows:
        return Fetched(shares=[Share(s.url.rstrip("/")) for s in servers])
    limits = (concurrency, timeout_s, retries)
    return asyncio.run(_Fetch(servers, rows, out_dir, limits, done, dropped).run())
