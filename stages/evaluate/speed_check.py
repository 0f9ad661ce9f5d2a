"""A second measurement of an evaluation server's speed by other code, on the same warm server,
each timing right beside the stage's own (`eval.speed_check`; serving._speed interleaves the
two), so that the ratio a user is shown is checked by a measurement that shares nothing with it
but the server, the prompts and the moment.

What differs from the stage's timing (serving._speed): the client (plain HTTP from a pool of
threads, http.client with one kept-alive connection per thread, not asyncio and aiohttp), the
warm-up (two untimed passes of its own), and the count (the server's `usage`, summed by this
code). What is the same is the definition of the rate: steady state, each user (thread) sending
its next request as soon as its last is answered, counted from the moment every user has had an
answer. benchmarks/speed_probe.py measures
fresh servers with this same client.

    tok_s = rate(base, model_id, prompts, max_tokens=96, at_once=True, min_pass_s=5)
    rates = measure({"draft": (base, model_id), ...}, prompts, c1_prompts=16, max_tokens=96,
                    repeats=5, min_pass_s=5)   # {"draft": {"c1": [tok/s, ...], ...}, ...}
"""

from __future__ import annotations

import concurrent.futures
import http.client
import itertools
import json
import threading
import time
import urllib.parse
from typing import Any

from runner.assets.prompts import Prompt, messages

# Untimed passes (concurrency 1, then the batch) before the timed ones.
WARM_PASSES = 2
# The most the two measurements of a ratio may differ by before the check says they disagree:
# the speed goal the GPU measurements were held to (docs/benchmarks.md), above the spread of one
# server's repeats measured on the H200 (sd of the per-repeat ratios 0.02 to 0.06).
AGREE_WITHIN = 0.10


class _Client(threading.local):
    """One kept-alive HTTP connection per thread: a new connection for every request held the
    check's client below a fast server's rate at a batch of 80 (docs/benchmarks.md)."""

    conn: http.client.HTTPConnection | None = None

    def completion_tokens(self, base: str, body: dict[str, Any], timeout_s: float) -> int:
        url = urllib.parse.urlsplit(base)
        for attempt in (0, 1):  # once more on a fresh connection if the server dropped this one
            if self.conn is None:
                self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
            try:
                self.conn.request(
                    "POST",
                    f"{url.path.rstrip('/')}/v1/chat/completions",
                    json.dumps(body),
                    {"Content-Type": "application/json"},
                )
                r = self.conn.getresponse()
                answer = r.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise
                continue
            if r.status != 200:
                raise RuntimeError(
                    f"a speed check request failed: HTTP {r.status}: {answer[:300]!r}"
                )
            return int(json.loads(answer)["usage"]["completion_tokens"])
        raise AssertionError("unreachable")


def rate(
    base: str,
    model: str,
    prompts: list[Prompt],
    max_tokens: int,
    at_once: bool,
    timeout_s: float = 600.0,
    min_pass_s: float = 0.0,
) -> float:
    """Generated tokens per second at steady state over `prompts`, greedy: one thread going
    through them in turn, or one thread per prompt (`at_once`), each sending its next request as
    soon as its last is answered. Counted: the answers after every thread has had one, until
    `min_pass_s` seconds have passed and every thread has gone through its prompts once more;
    the rate is the sum of the threads' own rates over those answers."""
    client = _Client()
    users = [list(prompts)] if not at_once else [[p] for p in prompts]
    lock = threading.Lock()
    stop = threading.Event()
    answered: set[int] = set()  # threads with one answer: the window opens when all have
    opened: list[float] = []
    # Per thread: (answers, tokens, first, last): its answers inside the window, from its last
    # answer before it to its last inside it.
    inside: dict[int, tuple[int, int, float, float]] = {}
    through = 0  # threads that went through all their prompts inside the window

    def user(u: int) -> None:
        nonlocal through
        mine, before = users[u], time.perf_counter()
        for i in itertools.count():
            body = {
                "model": model,
                "messages": messages(mine[i % len(mine)]),
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "seed": 0,
            }
            try:
                n = client.completion_tokens(base, body, timeout_s)
            except BaseException:
                stop.set()  # the others stop too; this error is the one raised
                raise
            now = time.perf_counter()
            with lock:
                if stop.is_set():
                    return  # in flight when the window closed: not counted
                if opened:
                    k, had, first, _ = inside.get(u, (0, 0, before, before))
                    inside[u] = (k + 1, had + n, first, now)
                    if k + 1 == len(mine):
                        through += 1
                    if now - opened[0] >= min_pass_s and through == len(users):
                        stop.set()
                        return
                else:
                    answered.add(u)
                    if len(answered) == len(users):
                        opened.append(now)
            before = now

    with concurrent.futures.ThreadPoolExecutor(len(users)) as pool:
        for f in [pool.submit(user, u) for u in range(len(users))]:
            f.result()
    # The threads' own rates, summed (each thread's answers are one after another).
    return sum(n / (last - first) for _, n, first, last in inside.values())


def measure(
    servers: dict[str, tuple[str, str]],
    prompts: list[Prompt],
    c1_prompts: int,
    max_tokens: int,
    repeats: int,
    warm_passes: int = WARM_PASSES,
    min_pass_s: float = 0.0,
) -> dict[str, dict[str, list[float]]]:
    """Each server's two rates (`servers`: label -> (base URL, model id)), `repeats` times each
    after `warm_passes` untimed passes: at concurrency 1 over the first `c1_prompts` prompts and
    at the batch of all of them. Several servers are timed in turn at every pass, the order
    reversed from one pass to the next."""
    out: dict[str, dict[str, list[float]]] = {label: {"c1": [], "batch": []} for label in servers}
    labels = list(servers)
    for i in range(warm_passes + repeats):
        order = labels if i % 2 == 0 else labels[::-1]
        for kind, chosen, at_once in (
            ("c1", prompts[:c1_prompts], False),
            ("batch", prompts, True),
        ):
            for label in order:
                base, model = servers[label]
                got = rate(base, model, chosen, max_tokens, at_once, min_pass_s=min_pass_s)
                if i >= warm_passes:
                    out[label][kind].append(got)
    return out


def agreement(
    stage: dict[str, float],
    check: dict[str, float],
    noise: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The check's ratios beside the stage's: for each of c1 and batch, the check's ratio and the
    stage's relative difference from it; `speed_check_agrees` is 1 when every one is within
    AGREE_WITHIN. `noise` (kind -> half-width of the 95% interval, on the log scale, of the two
    clients' per-repeat differences: measures.paired_noise) adds
    `speed_check_{kind}_within_noise`: whether the two differ by less than that noise, which
    says whether a miss of AGREE_WITHIN is a fault of the measurement or too few repeats to
    resolve 10%."""
    import math

    out: dict[str, Any] = {}
    ok = True
    for kind, theirs in check.items():
        ours = stage.get(kind)
        if ours is None or not theirs:
            continue
        diff = ours / theirs - 1
        out[f"speed_check_{kind}"] = theirs
        out[f"speed_check_{kind}_diff"] = diff
        ok = ok and abs(diff) <= AGREE_WITHIN
        if noise and kind in noise:
            out[f"speed_check_{kind}_noise"] = math.exp(noise[kind]) - 1
            inside = abs(math.log(ours / theirs)) <= noise[kind]
            out[f"speed_check_{kind}_within_noise"] = int(inside)
    if out:
        out["speed_check_agrees"] = int(ok)
    return out
