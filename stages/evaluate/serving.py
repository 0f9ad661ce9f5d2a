"""The evaluation's servers: the target served by vLLM (with a draft as an EAGLE-3 speculator,
or alone), warmed, each prompt set generated greedily with its speculative-decoding counters read
around it, per-prompt counts, the likeliest tokens for the identity check, and warm speed.

    start_s, per_set = serve_sets(cfg, facts, draft, sets, "draft", logs, speed_repeats=5)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from runner.assets.prompts import Prompt, messages
from runner.assets.target_facts import ModelFacts
from runner.core.errors import StageError
from runner.core.schema import RunnerConfig
from runner.integrations.speculators_config import recorded_settings, resolve_train_config
from runner.integrations.versions import VLLM_DISTS, installed
from runner.integrations.vllm import per_request_spec_metrics
from runner.serving.settings import draft_fields
from runner.serving.vllm_server import (
    ExistingServer,
    VllmServer,
    counters_delta,
    engine_args,
    guarded,
    quiet_http_logs,
    request_counters,
    serve,
)
from stages.evaluate import speed_check
from stages.evaluate.measures import first_difference

log = logging.getLogger("runner")


def server_args(cfg: RunnerConfig, draft: Path | None) -> list[str]:
    """Flags for an evaluation server: the target, plus the draft as an EAGLE-3 speculator."""
    args = engine_args(cfg, cfg.eval.max_model_len)
    if draft is not None and per_request_in_responses(cfg):
        args += ["--per-request-spec-decode-metrics", "summary"]
    if draft is not None:
        spec = {
            "method": "eagle3",
            "model": str(draft),
            "num_speculative_tokens": cfg.eval.num_speculative_tokens,
            **draft_fields(cfg.hardware.vllm, draft_is_mla(draft)),
        }
        args += ["--speculative-config", json.dumps(spec)]
    return args


def draft_is_mla(draft: Path) -> bool:
    """Whether a draft folder's attention is MLA (a latent KV rank anywhere in its config, as in
    public MLA drafts of Kimi-K2.5); the drafts this runner trains have standard attention."""
    try:
        config = json.loads((Path(draft) / "config.json").read_text())
    except (OSError, ValueError):
        return False

    def rank(node: Any) -> bool:
        if isinstance(node, dict):
            return bool(node.get("kv_lora_rank")) or any(rank(v) for v in node.values())
        return isinstance(node, list) and any(rank(v) for v in node)

    return rank(config)


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


async def _in_turn(one: Any, prompts: list[Prompt]) -> list[Any]:
    return [await one(i, p) for i, p in enumerate(prompts)]


async def _generate_all(
    server: VllmServer | ExistingServer,
    prompts: list[Prompt],
    cfg: RunnerConfig,
    one_at_a_time: bool = False,
    likeliest: bool = False,
    counting: str | None = None,
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
    answered, last = 0, time.time()
    async with openai.AsyncOpenAI(base_url=server.url, api_key="EMPTY", max_retries=0) as client:

        async def one(i: int, prompt: Prompt) -> Any:
            nonlocal answered, last
            try:
                got = await client.chat.completions.create(
                    model=server.model_id,
                    messages=messages(prompt),
                    temperature=0.0,
                    max_tokens=e.max_new_tokens,
                    seed=0,
                    extra_body=extra,
                    **({"logprobs": True, "top_logprobs": TOP_LOGPROBS} if likeliest else {}),
                )
                answered += 1
                # `counting` names the set: a line every PROGRESS_EVERY_S while it is served
                # (a set of long multi-turn prompts takes minutes on a CPU).
                if counting and time.time() - last >= PROGRESS_EVERY_S and answered < len(prompts):
                    last = time.time()
                    log.info(
                        "[evaluate] %s: %d/%d prompts answered", counting, answered, len(prompts)
                    )
                return got
            except Exception as exc:
                server.check_alive()
                raise StageError(
                    f"evaluation request for prompt {i} failed: {type(exc).__name__}: {exc}"
                ) from None

        try:
            async with asyncio.timeout(e.timeout_s):
                if one_at_a_time:
                    return await guarded(server, _in_turn(one, prompts))
                return await guarded(
                    server, asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
                )
        except TimeoutError:
            raise StageError(
                f"generating {len(prompts)} prompts took longer than eval.timeout_s={e.timeout_s}"
            ) from None


TOP_LOGPROBS = 5
# Seconds between the prompt counter's lines while a set is served.
PROGRESS_EVERY_S = 30.0


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


Server = VllmServer | ExistingServer


def alternating(labels: list[str], passes: int) -> list[list[str]]:
    """The order the servers are timed in at each pass: the first order, then its reverse, and so
    on (A B, B A, A B, ...), so that a drift that runs through a pair of passes cancels."""
    return [labels if i % 2 == 0 else labels[::-1] for i in range(passes)]


def _speed(
    servers: dict[str, Server],
    prompts: list[Prompt],
    cfg: RunnerConfig,
    repeats: int,
    check: bool = False,
) -> dict[str, dict[str, Any]]:
    """Generated tokens per second of each server, warm, `repeats` times each: at concurrency 1
    (the first eval.speed_prompts prompts one after another) and at the evaluation's batch (the
    set's prompts all at once). One pass of both comes first, untimed: the batch's shapes are new
    to a server after the warm-up, and the first pass at them ran slower. With several servers
    up, each pass times them in turn, in alternating order. Each timing's start (Unix time) is
    kept under "at", to set beside the machine's own record of those seconds (GPU clocks, load).

    With `check` (eval.speed_check), the independent client (speed_check.rate) times the same
    server at the same concurrency right beside each of these timings, the two clients' order
    alternating, after its own untimed passes. Timed in separate blocks, one after the other,
    the two clients met different states of the machine: one server's passes on the H200 moved
    between two levels 25% apart, so two blocks of 5 differed by up to 14% with no fault in
    either client (docs/benchmarks.md). Side by side, both read the same state, and the
    per-repeat differences between them (measures.paired_noise) are the check's noise."""
    labels = list(servers)
    few = prompts[: cfg.eval.speed_prompts]
    # (kind, prompts, one user going through them, streams): concurrency 1, the batch (a user
    # per prompt), and each level of eval.concurrency above 1 (that many users sharing the
    # prompts); the independent client times the first two.
    kinds = [("c1", few, True, None), ("batch", prompts, False, None)]
    kinds += [(f"c{n}", prompts, False, n) for n in cfg.eval.concurrency if n > 1]
    checked = ("c1", "batch")

    def empty(names: list[str]) -> dict[str, Any]:
        return {**{k: [] for k in names}, "at": {k: [] for k in names}}

    out: dict[str, dict[str, Any]] = {label: empty([k[0] for k in kinds]) for label in labels}
    if check:
        for label in labels:
            out[label]["check"] = empty(list(checked))
    turn = 0  # which client goes first, alternating from one timing to the next
    for i, order in enumerate(alternating(labels, 1 + repeats)):
        for kind, chosen, alone, streams in kinds:
            for label in order:
                server = servers[label]

                def ours(server=server, chosen=chosen, alone=alone, streams=streams) -> float:
                    return asyncio.run(_rate(server, chosen, cfg, alone, streams))

                def theirs(server=server, chosen=chosen, alone=alone) -> float:
                    return speed_check.rate(
                        server.base,
                        server.model_id,
                        chosen,
                        cfg.eval.max_new_tokens,
                        at_once=not alone,
                        min_pass_s=cfg.eval.speed_pass_s,
                    )

                also = check and kind in checked
                if i == 0:  # untimed: each client's own warm-up
                    ours()
                    for _ in range(speed_check.WARM_PASSES if also else 0):
                        theirs()
                    continue
                clients = [("stage", ours), *([("check", theirs)] if also else [])]
                for who, measure in clients[::-1] if turn % 2 else clients:
                    into = out[label] if who == "stage" else out[label]["check"]
                    into["at"][kind].append(round(time.time(), 3))
                    into[kind].append(measure())
                turn += 1
    return out


def _users(prompts: list[Prompt], one_at_a_time: bool, streams: int | None) -> list[list[Prompt]]:
    """The prompts each user of a timed pass goes through: one user through all of them
    (concurrency 1), one user per prompt, or `streams` users sharing them in turn (user u takes
    prompts u, u + streams, ..., wrapping round when there are more users than prompts)."""
    if one_at_a_time:
        return [list(prompts)]
    if streams is None:
        return [[p] for p in prompts]
    each = max(1, -(-len(prompts) // streams))
    return [
        [prompts[(u + j * streams) % len(prompts)] for j in range(each)] for u in range(streams)
    ]


async def _rate(
    server: Server,
    prompts: list[Prompt],
    cfg: RunnerConfig,
    one_at_a_time: bool,
    streams: int | None = None,
) -> float:
    """Generated tokens per second at steady state (the server's own count), greedy: one user
    going through `prompts` in turn (concurrency 1), one user per prompt, all at once, or
    `streams` users sharing the prompts in turn (user u takes prompts u, u + streams, ...,
    wrapping round when there are more users than prompts). Each
    user sends its next request the moment its last is answered, so the server holds the same
    number of requests throughout; no round waits for its slowest request (rounds of a batch
    under a second long lost 7% to 14% of a fast server's rate to their start and tail, against
    2% to 3% of a slow one's: benchmarks/speed_clients.py). Counted: the answers after the
    moment every user has had one, until eval.speed_pass_s has passed and every user has gone
    through its prompts once more; the rate is the sum of the users' own rates over those
    answers. Plain HTTP: the OpenAI client library's own work per request held the rate of 80
    requests at once about a quarter below what the server gave another client, and a speed
    figure must be the server's."""
    import aiohttp

    e = cfg.eval

    async def one(http: aiohttp.ClientSession, prompt: Prompt) -> int:
        body = {
            "model": server.model_id,
            "messages": messages(prompt),
            "temperature": 0.0,
            "max_tokens": e.max_new_tokens,
            "seed": 0,
        }
        async with http.post(f"{server.url}/chat/completions", json=body) as r:
            answer = await r.json()
            if r.status != 200:
                server.check_alive()
                raise StageError(f"a speed request failed: HTTP {r.status}: {str(answer)[:300]}")
        return int(answer["usage"]["completion_tokens"])

    users = _users(prompts, one_at_a_time, streams)
    answered: set[int] = set()  # users with one answer: the window opens when all have
    opened: list[float] = []
    # Per user, its tokens answered inside the window and the span they took: from its last
    # answer before the window to its last inside it, whole requests only.
    tokens, counted = [0] * len(users), [0] * len(users)
    span: list[list[float]] = [[] for _ in users]
    stop = asyncio.Event()

    async def user(http: aiohttp.ClientSession, u: int) -> None:
        mine, i, before = users[u], 0, time.perf_counter()
        while not stop.is_set():
            n = await one(http, mine[i % len(mine)])
            now, i = time.perf_counter(), i + 1
            if stop.is_set():
                break  # in flight when the window closed: not counted
            if opened:
                span[u] = [span[u][0] if span[u] else before, now]
                tokens[u] += n
                counted[u] += 1
                # Long enough, and every user through its prompts once inside the window.
                if now - opened[0] >= e.speed_pass_s and all(
                    c >= len(us) for c, us in zip(counted, users, strict=True)
                ):
                    stop.set()
            else:
                answered.add(u)
                if len(answered) == len(users):
                    opened.append(now)
            before = now

    timeout = aiohttp.ClientTimeout(total=e.timeout_s)
    connector = aiohttp.TCPConnector(limit=len(users))
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        await guarded(server, asyncio.gather(*(user(http, u) for u in range(len(users)))))
    # Each user's own rate, summed: exact however the users' answers line up in time (users
    # repeating one greedy prompt each stay in step, and a shared window would cut their
    # rounds at an arbitrary point).
    return sum(n / (t1 - t0) for n, (t0, t1) in zip(tokens, span, strict=True))


def _timed(
    servers: dict[str, Server], first: list[Prompt], cfg: RunnerConfig, repeats: int
) -> dict[str, dict[str, Any]]:
    """Each server's speed (`_speed`; with eval.speed_check, each timing beside the independent
    client's), and whether each server's graphs were compiled in this start."""
    log.info(
        "[evaluate] %s: timing (1 untimed pass, then %d timed) at concurrency 1 and at batch %d%s",
        " and ".join(servers),
        repeats,
        len(first),
        ", the servers' passes alternating" if len(servers) > 1 else "",
    )
    if cfg.eval.speed_check:
        log.info(
            "[evaluate] each timing beside another by an independent client (eval.speed_check)"
        )
    with quiet_http_logs():
        speed = _speed(servers, first, cfg, repeats, check=cfg.eval.speed_check)
    for label, s in servers.items():
        if isinstance(s, VllmServer):
            speed[label]["compile_cache"] = s.compile_cache()
    return speed


def rescore(
    server: Server, prompt_ids: list[int], served: list[int], j: int, timeout_s: float
) -> dict[str, Any]:
    """The target alone re-reading a served output's prefix in one forward (the verifier's
    shape: the prompt and the served tokens up to and including position `j`, prefilled at once,
    no cached prefix): the rank it gives the served token at `j` (1: its own pick) and its own
    pick there. {} when the server gives no prompt logprobs."""
    import json
    import urllib.request
    import uuid

    body = {
        "model": server.model_id,
        "prompt": [*prompt_ids, *served[: j + 1]],
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": TOP_LOGPROBS,
        # A fresh cache key: every position is computed in this forward, none from the blocks
        # the earlier decoding left.
        "cache_salt": uuid.uuid4().hex,
    }
    request = urllib.request.Request(
        f"{server.url}/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            answer = json.loads(r.read())
        last = answer["choices"][0]["prompt_logprobs"][-1]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return {}
    ranks = {int(k): v for k, v in last.items()}
    took = ranks.get(served[j])
    top = next((k for k, v in ranks.items() if v.get("rank") == 1), None)
    # vLLM lists the prompt's own token with its rank; one missing is beyond the likeliest.
    return {"rank": int(took["rank"]) if took else len(ranks) + 1, "top": top}


def _rescored(
    server: Server, outs: list[Any], served: list[list[int]], cfg: RunnerConfig
) -> dict[int, dict[str, Any]]:
    """For each output the draft-served server took off the target's greedy path beyond the
    near-tie filter, the target's re-reading of the served prefix (`rescore`)."""
    from stages.evaluate.measures import NEAR_TIE, divergence

    found: dict[int, dict[str, Any]] = {}
    for i, (o, mine) in enumerate(zip(outs, served, strict=True)):
        choice = o.choices[0]
        d = divergence(mine, list(choice.token_ids), _likeliest(choice), cfg.eval.near_tie_gap)
        if d is None or d["verdict"] == NEAR_TIE or d["draft_token"] is None:
            continue
        prompt_ids = _prompt_ids(o)
        if prompt_ids:
            found[i] = rescore(server, list(prompt_ids), mine, d["position"], cfg.eval.timeout_s)
    return found


def _prompt_ids(o: Any) -> list[int] | None:
    """The prompt's token ids as the server rendered them (request field return_token_ids)."""
    ids = getattr(o, "prompt_token_ids", None) or (o.model_extra or {}).get("prompt_token_ids")
    return list(ids) if ids else None


async def _read_all(
    server: Server, prompt_ids: list[list[int]], served: list[list[int]], cfg: RunnerConfig
) -> list[dict[str, Any]]:
    """The target alone reading each served output: its prompt and every served token prefilled
    in one forward with prompt_logprobs, no cached prefix. Per output, the target's likeliest
    tokens at each served position ((id, logprob), likeliest first) and its own pick there: its
    greedy choice given the served prefix, so the first position where the two differ is where
    the served output left the target's greedy path."""
    import aiohttp  # vLLM's client stack: installed with it

    async def one(http: aiohttp.ClientSession, i: int) -> dict[str, Any]:
        body = {
            "model": server.model_id,
            "prompt": [*prompt_ids[i], *served[i]],
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": TOP_LOGPROBS,
            "cache_salt": f"identity-{i}-{time.time_ns()}",
        }
        try:
            async with http.post(f"{server.url}/completions", json=body) as r:
                answer = await r.json()
            rows = answer["choices"][0]["prompt_logprobs"][len(prompt_ids[i]) :]
        except Exception as exc:
            server.check_alive()
            raise StageError(
                f"the target could not read served output {i} (prompt_logprobs): "
                f"{type(exc).__name__}: {exc}"
            ) from None
        top, picks, ranks = [], [], []
        for token, row in zip(served[i], rows, strict=True):
            listed = {int(k): v for k, v in (row or {}).items()}
            by_rank = sorted(listed.items(), key=lambda kv: int(kv[1].get("rank") or 1 << 30))
            top.append([(k, float(v["logprob"])) for k, v in by_rank[:TOP_LOGPROBS]])
            picks.append(by_rank[0][0] if by_rank else -1)
            took = listed.get(token)
            ranks.append(int(took["rank"]) if took else len(listed) + 1)
        return {"token_ids": picks, "likeliest": top, "ranks": ranks}

    timeout = aiohttp.ClientTimeout(total=cfg.eval.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        return await guarded(server, asyncio.gather(*(one(http, i) for i in range(len(served)))))


def read_sets(
    server: Server, spec: dict[str, dict], cfg: RunnerConfig, label: str = "target"
) -> dict[str, dict]:
    """The identity check by prefill (eval.identity=prefill): per set of the draft-served
    results `spec`, the target's own picks along each served output (`token_ids`, as long as
    the served output), its likeliest tokens there, and `rescored`: at the first position where
    the served output left the target's pick, the served token's rank in that same forward."""
    out: dict[str, dict] = {}
    for name, result in spec.items():
        if any(ids is None for ids in result["prompt_ids"]):
            raise StageError(
                "vLLM returned no prompt token ids (request field return_token_ids); set "
                "eval.identity=generate, or see hardware.vllm.command"
            )
        t0 = time.time()
        with quiet_http_logs():
            read = asyncio.run(_read_all(server, result["prompt_ids"], result["token_ids"], cfg))
        took = time.time() - t0
        log.info(
            "[evaluate] %s: %s, %d served outputs read in one prefill each in %.1f s",
            label,
            name,
            len(read),
            took,
        )
        rescored = {}
        for i, (r, mine) in enumerate(zip(read, result["token_ids"], strict=True)):
            j = first_difference(mine, r["token_ids"])
            if j is not None:
                rescored[i] = {"rank": r["ranks"][j], "top": r["token_ids"][j]}
        out[name] = {
            "token_ids": [r["token_ids"] for r in read],
            "likeliest": [r["likeliest"] for r in read],
            "rescored": rescored,
            "generate_s": took,
            "read_by": "prefill",
        }
    return out


def _generate_sets(
    server: Server,
    sets: dict[str, list[Prompt]],
    cfg: RunnerConfig,
    label: str,
    drafting: bool,
    likeliest: bool,
    served: dict[str, list[list[int]]] | None = None,
) -> dict[str, dict]:
    """Warm `server`, then generate each prompt set in turn, its counters read around it; per
    set, the outputs and counters (`drafting`: the server serves a draft). `served`: the
    draft-served outputs, whose divergences from this (target-alone) server's own are re-read
    by it while it is up (`rescored` per set: prompt index -> rank)."""
    out: dict[str, dict] = {}
    with quiet_http_logs():
        _warm(server, next(iter(sets.values())), cfg)
    for name, prompts in sets.items():
        before = server.spec_decode_counters()
        t0 = time.time()
        with quiet_http_logs():
            outs = asyncio.run(
                _generate_all(
                    server, prompts, cfg, likeliest=likeliest, counting=f"{label}: {name}"
                )
            )
        gen_s = time.time() - t0
        # Counters are cumulative since start; the difference is exactly these prompts.
        counters = counters_delta(server.spec_decode_counters(), before) if drafting else None
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
        per_prompt, source = _per_prompt(server, prompts, outs, cfg) if drafting else ([], "")
        out[name] = {
            "per_prompt": per_prompt,
            "per_prompt_source": source,
            "generate_s": gen_s,
            "token_ids": [list(o.choices[0].token_ids) for o in outs],
            "texts": [o.choices[0].message.content or "" for o in outs],
            "prompt_tokens": [o.usage.prompt_tokens for o in outs],
            "prompt_ids": [_prompt_ids(o) for o in outs],
            "counters": counters,
            **({"likeliest": [_likeliest(o.choices[0]) for o in outs]} if likeliest else {}),
        }
        if served is not None and likeliest and name in served:
            with quiet_http_logs():
                out[name]["rescored"] = _rescored(server, outs, served[name], cfg)
    return out


def _announce(label: str, sets: dict[str, list[Prompt]]) -> None:
    log.info(
        "[evaluate] %s: %s on a vLLM server (its log: logs/vllm_%s.log)",
        label,
        ", ".join(f"{len(p)} {name} prompts" for name, p in sets.items()),
        label,
    )


def serve_sets(
    cfg: RunnerConfig,
    facts: ModelFacts,
    draft: Path | None,
    sets: dict[str, list[Prompt]],
    label: str,
    logs: Path,
    likeliest: bool = False,
    speed_repeats: int = 0,
    served: dict[str, list[list[int]]] | None = None,
) -> tuple[float, dict[str, dict]]:
    """Start a server for the target (with `draft` if given), warm it, generate each prompt set
    in turn (its counters read around it), measure its speed on the first set (warm,
    `speed_repeats` times), and stop it. Returns the start-up seconds and, per set, the outputs
    and counters (the first set's with "speed")."""
    _announce(label, sets)
    server = serve(
        cfg,
        facts.path,
        server_args(cfg, draft),
        logs / f"vllm_{label}.log",
        label=f"evaluate:{label}",
    )
    # (`logs` is in the stage's scratch folder: a failed evaluation keeps its servers' logs there.)
    with server:
        out = _generate_sets(server, sets, cfg, label, draft is not None, likeliest, served)
        if speed_repeats:
            first = next(iter(sets.values()))
            out[next(iter(sets))]["speed"] = _timed({label: server}, first, cfg, speed_repeats)[
                label
            ]
    return server.start_s, out


def serve_reading(
    cfg: RunnerConfig,
    facts: ModelFacts,
    spec: dict[str, dict],
    sets: dict[str, list[Prompt]],
    logs: Path,
    speed_repeats: int = 0,
) -> tuple[float, dict[str, dict]]:
    """The target alone started, reading every draft-served output of `spec` (`read_sets`),
    timed on the first set when `speed_repeats`, and stopped: its start-up seconds and, per set,
    its picks along the served outputs."""
    log.info(
        "[evaluate] target: reading %s served outputs on a vLLM server (its log: "
        "logs/vllm_target.log)",
        " + ".join(str(len(r["token_ids"])) for r in spec.values()),
    )
    server = serve(
        cfg, facts.path, server_args(cfg, None), logs / "vllm_target.log", label="evaluate:target"
    )
    with server:
        out = read_sets(server, spec, cfg)
        if speed_repeats:
            first = next(iter(sets))
            with quiet_http_logs():
                _warm(server, sets[first], cfg)
            out[first]["speed"] = _timed({"target": server}, sets[first], cfg, speed_repeats)[
                "target"
            ]
    return server.start_s, out


def serve_again(
    cfg: RunnerConfig,
    facts: ModelFacts,
    draft: Path,
    sets: dict[str, list[Prompt]],
    which: dict[str, list[int]],
    logs: Path,
) -> dict[str, dict[int, list[int]]]:
    """The prompts `which` (per set, their indices) served again with the draft on a fresh
    server, one at a time: no other request shares a batch with them, no block of the first
    pass is cached. Per set, prompt index -> generated token ids."""
    n = sum(len(ix) for ix in which.values())
    log.warning(
        "[evaluate] serving the %d output(s) proven to leave the target's greedy path again, "
        "alone on a fresh draft server (its log: logs/vllm_draft_again.log)",
        n,
    )
    server = serve(
        cfg,
        facts.path,
        server_args(cfg, draft),
        logs / "vllm_draft_again.log",
        label="evaluate:draft again",
    )
    out: dict[str, dict[int, list[int]]] = {}
    with server, quiet_http_logs():
        for name, ix in which.items():
            outs = asyncio.run(
                _generate_all(server, [sets[name][i] for i in ix], cfg, one_at_a_time=True)
            )
            out[name] = {i: list(o.choices[0].token_ids) for i, o in zip(ix, outs, strict=True)}
    return out


def halved(args: list[str]) -> list[str]:
    """Server flags with the memory they may take halved (--gpu-memory-utilization and
    --kv-cache-memory-bytes): two servers side by side on the same devices."""
    out = list(args)
    for flag, kind in (("--gpu-memory-utilization", float), ("--kv-cache-memory-bytes", int)):
        if flag in out:
            i = out.index(flag) + 1
            out[i] = str(kind(float(out[i]) / 2))
    return out


def serve_together(
    cfg: RunnerConfig,
    facts: ModelFacts,
    draft: Path,
    sets: dict[str, list[Prompt]],
    logs: Path,
    speed_repeats: int,
) -> tuple[float, dict[str, dict], dict[str, dict]]:
    """The draft-served server and the target alone up at once (eval.speed_servers), each with
    half of the memory settings: the draft's server starts first; the target's starts while the
    draft's generates (untimed), then generates with its likeliest tokens; then both are timed
    with their passes alternating, so that the ratio compares rates measured seconds apart.
    Returns the draft server's start-up seconds and both servers' results as serve_sets gives
    them (the first set's with "speed")."""
    servers: dict[str, VllmServer] = {}
    for label, d in (("draft", draft), ("target", None)):
        servers[label] = VllmServer.from_config(
            cfg,
            facts.path,
            halved(server_args(cfg, d)),
            logs / f"vllm_{label}.log",
            label=f"evaluate:{label}",
        )
    with contextlib.ExitStack() as stack:
        for s in servers.values():
            stack.callback(s.stop)
        _announce("draft", sets)
        servers["draft"].start()
        servers["draft"].wait_ready()
        log.info("[evaluate] target: starting beside the draft's server (eval.speed_servers)")
        servers["target"].start()
        spec = _generate_sets(servers["draft"], sets, cfg, "draft", True, likeliest=False)
        _announce("target", sets)
        servers["target"].wait_ready()
        served = {name: result["token_ids"] for name, result in spec.items()}
        target = _generate_sets(
            servers["target"], sets, cfg, "target", False, likeliest=True, served=served
        )
        if speed_repeats:
            first_name = next(iter(sets))
            speed = _timed(dict(servers), sets[first_name], cfg, speed_repeats)
            spec[first_name]["speed"] = speed["draft"]
            target[first_name]["speed"] = speed["target"]
    return servers["draft"].start_s or 0.0, spec, target


def together(
    cfg: RunnerConfig, weights_per_gpu: float | None, gpu_memory_gib: float | None
) -> tuple[bool, str]:
    """Whether the evaluation's two servers run at once (eval.speed_servers), and why."""
    choice = cfg.eval.speed_servers
    if cfg.hardware.vllm.endpoint or not cfg.eval.compare_target:
        return False, "one server"
    if choice != "auto":
        return choice == "together", f"eval.speed_servers={choice}"
    if cfg.hardware.device != "cuda":
        return False, "auto: apart on a CPU"
    if not (weights_per_gpu and gpu_memory_gib):
        return False, (
            "auto: apart, the GPU's memory is not known (hardware.gpu_memory_gib) or the "
            "weights' size"
        )
    share = weights_per_gpu / (gpu_memory_gib * (1 << 30))
    if share <= TOGETHER_WEIGHTS_SHARE:
        return True, f"auto: the target's weights take {share:.1%} of a GPU"
    return False, f"auto: apart, the target's weights take {share:.0%} of a GPU"


# Two servers each hold the target's weights; at most this share of a GPU each leaves both half
# the memory with room for their KV caches.
TOGETHER_WEIGHTS_SHARE = 0.25


def gpu_memory_gib(cfg: RunnerConfig) -> float | None:
    """hardware.gpu_memory_gib, else the first visible GPU's memory as nvidia-smi reports it."""
    if cfg.hardware.gpu_memory_gib:
        return cfg.hardware.gpu_memory_gib
    import shutil
    import subprocess

    if cfg.hardware.device != "cuda" or shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
        return float(out[0]) / 1024 if out else None
    except (subprocess.SubprocessError, OSError, ValueError):
        return None


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
