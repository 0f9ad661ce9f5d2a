"""A second measurement of an evaluation server's speed by other code, on the same warm server,
right after the stage's own timing (`eval.speed_check`), so that the ratio a user is shown is
checked by a measurement that shares nothing with it but the server and the prompts.

What differs from the stage's timing (serving._speed): the client (plain HTTP from a pool of
threads, urllib, not asyncio and aiohttp), the warm-up (two untimed passes of its own), and the
count (the server's `usage`, summed per pass by this code). benchmarks/speed_probe.py measures
fresh servers with this same client.

    rates = measure({"draft": (base, model_id), ...}, prompts, c1_prompts=16, max_tokens=96,
                    repeats=5, min_pass_s=5)   # {"draft": {"c1": [tok/s, ...], ...}, ...}
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.request
from typing import Any

from runner.prompts import Prompt, messages

# Untimed passes (concurrency 1, then the batch) before the timed ones.
WARM_PASSES = 2
# The most the two measurements of a ratio may differ by before the check says they disagree:
# the goal of the GPU issue (docs/gpu.md), above the spread of one server's repeats measured on
# the H200 (sd of the per-repeat ratios 0.02 to 0.06).
AGREE_WITHIN = 0.10


def _completion_tokens(base: str, body: dict[str, Any], timeout_s: float) -> int:
    request = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as r:
        return int(json.loads(r.read())["usage"]["completion_tokens"])


def rate(
    base: str,
    model: str,
    prompts: list[Prompt],
    max_tokens: int,
    at_once: bool,
    timeout_s: float = 600.0,
    min_pass_s: float = 0.0,
) -> float:
    """Generated tokens per second over `prompts`, greedy, one after another or all at once
    (one thread each), the whole round again until `min_pass_s` seconds have passed."""

    def one(prompt: Prompt) -> int:
        body = {
            "model": model,
            "messages": messages(prompt),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "seed": 0,
        }
        return _completion_tokens(base, body, timeout_s)

    with concurrent.futures.ThreadPoolExecutor(len(prompts) if at_once else 1) as pool:
        t0 = time.perf_counter()
        tokens = 0
        while True:  # at least one round, then rounds until min_pass_s
            tokens += sum(pool.map(one, prompts) if at_once else map(one, prompts))
            if time.perf_counter() - t0 >= min_pass_s:
                return tokens / (time.perf_counter() - t0)


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
    AGREE_WITHIN. `noise` (kind -> half-width of the two ratios' 95% intervals on the log scale,
    combined: sqrt(h_stage^2 + h_check^2)) adds `speed_check_{kind}_within_noise`: whether the
    two differ by less than their own repeats' noise, which says whether a miss of AGREE_WITHIN
    is a fault of the measurement or too few repeats to resolve 10%."""
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
