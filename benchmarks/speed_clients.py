"""How much of a server's rate each speed client can see: the evaluate stage's client
(stages/evaluate/serving._rate) and the speed check's (stages/evaluate/speed_check.rate) against
a stand-in endpoint whose rate is known exactly, because it answers every request after a fixed
delay with a fixed token count. A client that reads a fast server lower than a slow one (its own
work per request or per round eats into short requests) biases the draft-over-target ratio; this
prints each client's fraction of the true rate at each delay and the bias that leaves in a ratio.

The delays default to what one H200 measured on the embedded default's servers (2026-12-03,
docs/benchmarks.md): at concurrency 1, 96-token answers at 452 tok/s (target) and
301 tok/s (draft-served); at a batch of 80, 16.4k and 6.0k tok/s. The stand-in runs in its own
process, so that it does not share this one's interpreter lock with the clients.

    python -m benchmarks.speed_clients [--pass-s 5] [--batch 80]

Prints one `BENCH` JSON line per client and kind, and one with the ratio bias per client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import socket
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

TOKENS = 96
# Seconds per request for (kind, server) at the H200's rates: TOKENS x users / tokens per second.
H200 = {
    ("c1", "target"): TOKENS / 452,
    ("c1", "draft"): TOKENS / 301,
    ("batch", "target"): TOKENS * 80 / 16_365,
    ("batch", "draft"): TOKENS * 80 / 5_975,
}


def serve_stand_in(
    port: int,
    delay_of: Callable[[str], float],
    watch: Callable[[Any, str], Any] | None = None,
    ready: Callable[[int], None] | None = None,
) -> None:
    """Serve the stand-in chat endpoint on `port` (0: any free one) until the process ends:
    each request answered with TOKENS tokens after delay_of(its last user turn) seconds.
    `watch(request, prompt)`, if given, is a context manager held around each answer (what
    tests/test_speed_clients.py records); `ready(port)` is called once it listens."""
    from aiohttp import web

    async def answer(request: web.Request) -> web.Response:
        prompt = (await request.json())["messages"][-1]["content"]
        with watch(request, prompt) if watch else contextlib.nullcontext():
            await asyncio.sleep(delay_of(prompt))
        return web.json_response({"choices": [{}], "usage": {"completion_tokens": TOKENS}})

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", answer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        if ready:
            ready(site._server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    asyncio.run(main())


def _stand_in(port: int, delay: multiprocessing.Value) -> None:
    serve_stand_in(port, lambda _prompt: delay.value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    from stages.evaluate import serving, speed_check

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pass-s", type=float, default=5.0, help="eval.speed_pass_s")
    p.add_argument("--batch", type=int, default=80, help="requests at once (eval.num_prompts)")
    args = p.parse_args()

    port = _free_port()
    delay = multiprocessing.Value("d", 0.1)
    server = multiprocessing.Process(target=_stand_in, args=(port, delay), daemon=True)
    server.start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(100):  # up within seconds
        try:
            speed_check.rate(base, "m", ["up?"], TOKENS, at_once=False)
            break
        except OSError:
            time.sleep(0.1)

    prompts = [f"prompt {i}" for i in range(args.batch)]
    cfg = SimpleNamespace(
        eval=SimpleNamespace(max_new_tokens=TOKENS, timeout_s=600, speed_pass_s=args.pass_s)
    )
    stage_server = SimpleNamespace(model_id="m", url=f"{base}/v1", check_alive=lambda: None)
    seen: dict[tuple[str, str, str], float] = {}
    try:
        for (kind, label), seconds in H200.items():
            delay.value = seconds
            users = 1 if kind == "c1" else args.batch
            true = TOKENS * users / seconds
            chosen = prompts[:16] if kind == "c1" else prompts
            got = {
                "stage": asyncio.run(
                    serving._rate(stage_server, chosen, cfg, one_at_a_time=kind == "c1")
                ),
                "check": speed_check.rate(
                    base, "m", chosen, TOKENS, at_once=kind == "batch", min_pass_s=args.pass_s
                ),
            }
            for client, rate in got.items():
                seen[client, kind, label] = rate / true
                print(
                    "BENCH "
                    + json.dumps(
                        {
                            "client": client,
                            "kind": kind,
                            "server": label,
                            "true_tok_s": round(true),
                            "read_tok_s": round(rate),
                            "fraction": round(rate / true, 4),
                        }
                    ),
                    flush=True,
                )
    finally:
        server.terminate()
    for client in ("stage", "check"):
        bias = {
            kind: round(seen[client, kind, "draft"] / seen[client, kind, "target"] - 1, 4)
            for kind in ("c1", "batch")
        }
        print("BENCH " + json.dumps({"client": client, "ratio_bias": bias}), flush=True)


if __name__ == "__main__":
    main()
