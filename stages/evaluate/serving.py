"""The evaluation's servers: the target served by vLLM (with a draft as an EAGLE-3 speculator,
or alone), warmed, each prompt set generated greedily with its speculative-decoding counters read
around it, per-prompt counts, the likeliest tokens for the identity check, and warm speed.

    start_s, per_set = serve_sets(cfg, facts, draft, sets, "draft", logs, speed_repeats=5)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from runner.errors import StageError
from runner.integrations.speculators import recorded_settings, resolve_train_config
from runner.integrations.vllm import per_request_spec_metrics
from runner.prompts import Prompt, messages
from runner.schema import RunnerConfig
from runner.target_facts import ModelFacts
from runner.versions import VLLM_DISTS, installed
from runner.vllm_server import (
    ExistingServer,
    VllmServer,
    counters_delta,
    engine_args,
    quiet_http_logs,
    request_counters,
    serve,
)
from stages.evaluate import speed_check

log = logging.getLogger("runner")


def server_args(cfg: RunnerConfig, draft: Path | None) -> list[str]:
    """Flags for an evaluation server: the target, plus the draft as an EAGLE-3 speculator."""
    args = engine_args(cfg, cfg.eval.max_model_len)
    if draft is not None and per_request_in_responses(cfg):
        args += ["--per-request-spec-decode-metrics", "summary"]
    if draft is not None:
        args += [
            "--speculative-config",
            json.dumps(
                {
                    "method": "eagle3",
                    "model": str(draft),
                    "num_speculative_tokens": cfg.eval.num_speculative_tokens,
                }
            ),
        ]
    return args


def per_request_in_responses(cfg: RunnerConfig) -> bool:
    """Whether the servers the runner starts give each response its own acceptance counts: this
    environment's vLLM (not hardware.vllm.command's, whose version is not known here) when it
    can."""
    if cfg.hardware.vllm.command or cfg.hardware.vllm.endpoint:
        return False
    return per_request_spec_metrics(installed(*VLLM_DISTS)[1])


def _per_prompt(
    server: VllmServer | ExistingServer, prompts: list[Prompt], outs: list[Any], cfg: RunnerConfig
) -> tuple[list[dict[str, Any]], str]:
    """Each prompt's acceptance counters and where they came from: the responses' own, or, from
    an engine that does not give them, each prompt generated alone between two reads of the
    server's counters (greedy: the same outputs, one at a time)."""
    found = [request_counters(o) for o in outs]
    if all(c is not None for c in found):
        return found, "response"  # type: ignore[return-value]
    log.info(
        "[evaluate] this vLLM gives no per-request acceptance; measuring %d prompts one at a "
        "time for the per-prompt table and its interval",
        len(prompts),
    )
    rows = []
    for p in prompts:
        before = server.spec_decode_counters()
        asyncio.run(_generate_all(server, [p], cfg))
        rows.append(counters_delta(server.spec_decode_counters(), before))
    return rows, "counters, one prompt at a time"


async def _generate_all(
    server: VllmServer | ExistingServer,
    prompts: list[Prompt],
    cfg: RunnerConfig,
    one_at_a_time: bool = False,
    likeliest: bool = False,
) -> list[Any]:
    """Every prompt at once (the server batches them), or one after another, greedy, with the
    generated token ids; `likeliest`: each generated position's likeliest tokens (ids) and their
    logprobs too."""
    import openai  # the client library takes a second to import; only evaluation needs it

    e = cfg.eval
    extra: dict[str, Any] = {"return_token_ids": True}
    if likeliest:
        extra["return_tokens_as_token_ids"] = True  # "token_id:123", not text
    # The target's likeliest tokens per position: enough to place a token the draft-served
    # output took at a three-way tie.
    async with openai.AsyncOpenAI(base_url=server.url, api_key="EMPTY", max_retries=0) as client:

        async def one(i: int, prompt: Prompt) -> Any:
            try:
                return await client.chat.completions.create(
                    model=server.model_id,
                    messages=messages(prompt),
                    temperature=0.0,
                    max_tokens=e.max_new_tokens,
                    seed=0,
                    extra_body=extra,
                    **({"logprobs": True, "top_logprobs": TOP_LOGPROBS} if likeliest else {}),
                )
            except Exception as exc:
                server.check_alive()
                raise StageError(
                    f"evaluation request for prompt {i} failed: {type(exc).__name__}: {exc}"
                ) from None

        try:
            async with asyncio.timeout(e.timeout_s):
                if one_at_a_time:
                    return [await one(i, p) for i, p in enumerate(prompts)]
                return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        except TimeoutError:
            raise StageError(
                f"generating {len(prompts)} prompts took longer than eval.timeout_s={e.timeout_s}"
            ) from None


TOP_LOGPROBS = 5


def _likeliest(choice: Any) -> list[list[tuple[int, float]]]:
    """Per generated position, the likeliest tokens as (id, logprob), likeliest first."""
    content = getattr(choice.logprobs, "content", None) or []
    return [
        [(int(t.token.split(":", 1)[1]), float(t.logprob)) for t in pos.top_logprobs]
        for pos in content
    ]


def _warm(server: VllmServer | ExistingServer, prompts: list[Prompt], cfg: RunnerConfig) -> None:
    """The same warm-up for every server before anything is measured: two requests one at a
    time, then a batch (CUDA graphs, compilation and caches settle in the first requests: a cold
    server measured 0.28x where the same servers warm measured 1.06x)."""
    asyncio.run(_generate_all(server, prompts[:2], cfg, one_at_a_time=True))
    asyncio.run(_generate_all(server, prompts[:8], cfg))


def _speed(
    server: VllmServer | ExistingServer, prompts: list[Prompt], cfg: RunnerConfig, repeats: int
) -> dict[str, list[float]]:
    """Generated tokens per second, warm, `repeats` times each: at concurrency 1 (the first
    eval.speed_prompts prompts one after another) and at the evaluation's batch (the set's
    prompts all at once). One pass of both comes first, untimed: the batch's shapes are new to
    the server after the warm-up, and the first pass at them ran slower."""
    out: dict[str, list[float]] = {"c1": [], "batch": []}
    few = prompts[: cfg.eval.speed_prompts]
    for timed in [False] + [True] * repeats:
        for kind, chosen, alone in (("c1", few, True), ("batch", prompts, False)):
            rate = asyncio.run(_rate(server, chosen, cfg, one_at_a_time=alone))
            if timed:
                out[kind].append(rate)
    return out


async def _rate(
    server: VllmServer | ExistingServer,
    prompts: list[Prompt],
    cfg: RunnerConfig,
    one_at_a_time: bool,
) -> float:
    """Generated tokens per second (the server's own count) over `prompts`, greedy, one after
    another or all at once. Plain HTTP: the OpenAI client library's own work per request held
    the rate of 80 requests at once about a quarter below what the server gave another client
    (docs/benchmarks.md), and a speed figure must be the server's, not the client's."""
    import aiohttp

    e = cfg.eval

    async def one(session: aiohttp.ClientSession, prompt: Prompt) -> int:
        body = {
            "model": server.model_id,
            "messages": messages(prompt),
            "temperature": 0.0,
            "max_tokens": e.max_new_tokens,
            "seed": 0,
        }
        async with session.post(f"{server.url}/chat/completions", json=body) as r:
            answer = await r.json()
            if r.status != 200:
                server.check_alive()
                raise StageError(f"a speed request failed: HTTP {r.status}: {str(answer)[:300]}")
        return int(answer["usage"]["completion_tokens"])

    timeout = aiohttp.ClientTimeout(total=e.timeout_s)
    connector = aiohttp.TCPConnector(limit=len(prompts))
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.perf_counter()
        if one_at_a_time:
            tokens = [await one(session, p) for p in prompts]
        else:
            tokens = await asyncio.gather(*(one(session, p) for p in prompts))
        return sum(tokens) / (time.perf_counter() - t0)


def serve_sets(
    cfg: RunnerConfig,
    facts: ModelFacts,
    draft: Path | None,
    sets: dict[str, list[Prompt]],
    label: str,
    logs: Path,
    likeliest: bool = False,
    speed_repeats: int = 0,
) -> tuple[float, dict[str, dict]]:
    """Start a server for the target (with `draft` if given), warm it, generate each prompt set
    in turn (its counters read around it), measure its speed on the first set (warm,
    `speed_repeats` times), and stop it. Returns the start-up seconds and, per set, the outputs
    and counters (the first set's with "speed")."""
    log.info(
        "[evaluate] %s: %s on a vLLM server (its log: logs/vllm_%s.log)",
        label,
        ", ".join(f"{len(p)} {name} prompts" for name, p in sets.items()),
        label,
    )
    server = serve(
        cfg,
        facts.path,
        server_args(cfg, draft),
        logs / f"vllm_{label}.log",
        label=f"evaluate:{label}",
    )
    out: dict[str, dict] = {}
    # (`logs` is in the stage's scratch folder: a failed evaluation keeps its servers' logs there.)
    with server:
        first = next(iter(sets.values()))
        with quiet_http_logs():
            _warm(server, first, cfg)
        for name, prompts in sets.items():
            before = server.spec_decode_counters()
            t0 = time.time()
            with quiet_http_logs():
                outs = asyncio.run(_generate_all(server, prompts, cfg, likeliest=likeliest))
            gen_s = time.time() - t0
            # Counters are cumulative since start; the difference is exactly these prompts.
            counters = (
                counters_delta(server.spec_decode_counters(), before) if draft is not None else None
            )
            if any(o.choices[0].token_ids is None for o in outs):
                # Without them "identical to the target" would compare empty lists.
                raise StageError(
                    "vLLM returned no generated token ids (request field return_token_ids); this "
                    "vLLM is too old for the evaluation, see hardware.vllm.command"
                )
            if counters is not None and counters["drafts"] == 0:
                raise StageError(
                    f"vLLM served the draft but counted no speculative drafts on {name}; see "
                    f"{server.log_path}"
                )
            accepted = (
                f", acceptance length {1 + counters['accepted'] / counters['drafts']:.3f}"
                if counters
                else ""
            )
            log.info(
                "[evaluate] %s: %s, %d prompts generated in %.1f s%s",
                label,
                name,
                len(prompts),
                gen_s,
                accepted,
            )
            per_prompt, source = (
                _per_prompt(server, prompts, outs, cfg) if draft is not None else ([], "")
            )
            out[name] = {
                "per_prompt": per_prompt,
                "per_prompt_source": source,
                "generate_s": gen_s,
                "token_ids": [list(o.choices[0].token_ids) for o in outs],
                "texts": [o.choices[0].message.content or "" for o in outs],
                "prompt_tokens": [o.usage.prompt_tokens for o in outs],
                "counters": counters,
                **({"likeliest": [_likeliest(o.choices[0]) for o in outs]} if likeliest else {}),
            }
        if speed_repeats:
            log.info(
                "[evaluate] %s: timing (1 untimed pass, then %d timed) at concurrency 1 and at "
                "batch %d",
                label,
                speed_repeats,
                len(first),
            )
            with quiet_http_logs():
                speed: dict[str, Any] = _speed(server, first, cfg, speed_repeats)
            if cfg.eval.speed_check:
                log.info(
                    "[evaluate] %s: the speed again, by an independent client (eval.speed_check)",
                    label,
                )
                speed["check"] = speed_check.measure(
                    server.base,
                    server.model_id,
                    first,
                    cfg.eval.speed_prompts,
                    cfg.eval.max_new_tokens,
                    speed_repeats,
                )
            if isinstance(server, VllmServer):
                speed["compile_cache"] = server.compile_cache()
            out[next(iter(sets))]["speed"] = speed
    return server.start_s, out


def random_draft(train_manifest: dict, dest: Path) -> Path:
    """A freshly initialised draft with the trained one's shape and vocab mapping
    (speculators' dry run of the same command)."""
    from speculators.train.cli import main as speculators_train  # imports torch: seconds

    settings = recorded_settings(train_manifest)
    # A dry run in this process: no MLflow logger, no sharding (that needs torchrun).
    for name in ("logger", "fsdp_shard"):
        settings.pop(name, None)
    settings.update(save_path=str(dest), dry_run=True)
    slots = tuple(train_manifest.get("slots", ()))
    speculators_train(resolve_train_config(settings, slots))
    return dest


def tokens_per_s(result: dict) -> float:
    return sum(len(t) for t in result["token_ids"]) / result["generate_s"]
