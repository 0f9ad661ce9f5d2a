"""Stage `evaluate`: measured acceptance of the trained draft under real speculative decoding.

Run alone: `python -m runner run.stages=[evaluate]` (needs train in the store).
The runner starts a vLLM server (runner/vllm_server.py, launched as `hardware.vllm` says) that
serves the target greedily on held-out prompts (MT-bench by default), one server per setting: with
the trained draft as an EAGLE-3 speculator (k speculative tokens), without a draft (the target's
own greedy output and speed), and optionally with a randomly initialised draft of the same shape
(`eval.random_baseline`). Acceptance comes from the server's Prometheus counters (/metrics:
drafts, draft tokens, accepted tokens, accepted per position), read before and after the prompts.
Reports mean acceptance length (1 + accepted / drafts), per-position acceptance, whether every
output equals the target's own, the speed ratio, and beside them the teacher-forced accuracies
from training.
Writes `eval_table.json` (one row per prompt), `summary.json` and the vLLM logs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runner.assets import load_prompt_sets
from runner.errors import ConfigError, StageError
from runner.integrations.speculators import recorded_settings, resolve_train_config
from runner.plan_tokenizer import file_stamp, plan_tokenizer, remembered
from runner.schema import RunnerConfig, prompt_set_name
from runner.stage import DRAFT, Plan, PlanView, ServerNeed, Stage, StageContext
from runner.store import damage
from runner.target_facts import ModelFacts, target_context
from runner.versions import VLLM_DISTS
from runner.vllm_server import (
    ExistingServer,
    VllmServer,
    counters_delta,
    engine_args,
    quiet_http_logs,
    serve,
    shell_command,
)

log = logging.getLogger("runner")
_NOT_IN_KEY = ("name", "timeout_s")


def _draft_content(folder: str) -> str | None:
    """sha256 of a draft folder's config and weights (eval.draft: what is served, wherever it
    lies); None if it is not a draft folder (the plan says so)."""
    import hashlib

    root = Path(folder).expanduser()
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        try:
            with open(root / name, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 24), b""):
                    h.update(block)
        except OSError:
            return None
    return h.hexdigest()


def key_config(cfg: RunnerConfig, facts: ModelFacts) -> dict[str, Any]:
    e = dataclasses.asdict(cfg.eval)
    if cfg.eval.draft:
        e["draft"] = _draft_content(cfg.eval.draft)
    return {
        **{k: v for k, v in e.items() if k not in _NOT_IN_KEY},
        "weights": facts.weights_id,
        "dtype": cfg.hardware.dtype,
        # Measured on a server the runner did not start: another measurement than its own.
        **({"endpoint": cfg.hardware.vllm.endpoint} if cfg.hardware.vllm.endpoint else {}),
    }


def server_args(cfg: RunnerConfig, draft: Path | None) -> list[str]:
    """Flags for an evaluation server: the target, plus the draft as an EAGLE-3 speculator."""
    args = engine_args(cfg, cfg.eval.max_model_len)
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


async def _generate_all(
    server: VllmServer | ExistingServer,
    prompts: list[str],
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

        async def one(i: int, prompt: str) -> Any:
            try:
                return await client.chat.completions.create(
                    model=server.model_id,
                    messages=[{"role": "user", "content": prompt}],
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


def _warm(server: VllmServer | ExistingServer, prompts: list[str], cfg: RunnerConfig) -> None:
    """The same warm-up for every server before anything is measured: two requests one at a
    time, then a batch (CUDA graphs, compilation and caches settle in the first requests: a cold
    server measured 0.28x where the same servers warm measured 1.06x)."""
    asyncio.run(_generate_all(server, prompts[:2], cfg, one_at_a_time=True))
    asyncio.run(_generate_all(server, prompts[:8], cfg))


def _speed(
    server: VllmServer | ExistingServer, prompts: list[str], cfg: RunnerConfig, repeats: int
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
    server: VllmServer | ExistingServer, prompts: list[str], cfg: RunnerConfig, one_at_a_time: bool
) -> float:
    """Generated tokens per second (the server's own count) over `prompts`, greedy, one after
    another or all at once. Plain HTTP: the OpenAI client library's own work per request held
    the rate of 80 requests at once about a quarter below what the server gave another client
    (docs/benchmarks.md), and a speed figure must be the server's, not the client's."""
    import aiohttp

    e = cfg.eval

    async def one(session: aiohttp.ClientSession, prompt: str) -> int:
        body = {
            "model": server.model_id,
            "messages": [{"role": "user", "content": prompt}],
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


def _serve(
    cfg: RunnerConfig,
    facts: ModelFacts,
    draft: Path | None,
    sets: dict[str, list[str]],
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
            out[name] = {
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
                out[next(iter(sets))]["speed"] = _speed(server, first, cfg, speed_repeats)
    return server.start_s, out


def _random_draft(train_manifest: dict, dest: Path) -> Path:
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


def acceptance(counters: dict) -> dict[str, Any]:
    drafts = counters["drafts"]
    out: dict[str, Any] = {
        "drafts": drafts,
        "draft_tokens": counters["draft_tokens"],
        "accepted_tokens": counters["accepted"],
        "acceptance_length": 1.0 + counters["accepted"] / drafts if drafts else float("nan"),
        "draft_acceptance_rate": counters["accepted"] / counters["draft_tokens"]
        if counters["draft_tokens"]
        else float("nan"),
    }
    for i, a in enumerate(counters["accepted_per_pos"]):
        out[f"acceptance_pos_{i}"] = a / drafts if drafts else float("nan")
    return out


def teacher_forced(train_metrics: dict[str, Any], k: int) -> dict[str, Any]:
    """Validation accuracies from training, per draft position, and the acceptance length they
    imply.

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


NEAR_TIE, MISMATCH, UNKNOWN = "near tie", "mismatch", "undetermined"


def divergence(
    draft_ids: list[int],
    target_ids: list[int],
    target_top: list[list[tuple[int, float]]],
    near_tie_gap: float,
) -> dict[str, Any] | None:
    """Where a served output first differs from the target's own greedy output, and whether that
    is a near tie: at that position the token the draft-served output took is among the
    target's likeliest (`target_top`, (id, logprob) per position, likeliest first) within
    `near_tie_gap` of the target's own choice (a stop where the target went on: its runner-up
    within the gap). None when the outputs are identical."""
    if draft_ids == target_ids:
        return None
    j = next(
        (i for i, (a, b) in enumerate(zip(draft_ids, target_ids, strict=False)) if a != b),
        min(len(draft_ids), len(target_ids)),
    )
    took = draft_ids[j] if j < len(draft_ids) else None
    row: dict[str, Any] = {"position": j, "draft_token": took}
    if j >= len(target_top) or len(target_top[j]) < 2:
        return {**row, "target_token": None, "gap": None, "verdict": UNKNOWN}
    first, lp1 = target_top[j][0]
    lp_took = dict(target_top[j]).get(took) if took is not None else target_top[j][1][1]
    # Not among the target's likeliest: at least as far below as the last of them.
    gap = lp1 - (lp_took if lp_took is not None else target_top[j][-1][1])
    near = lp_took is not None and gap <= near_tie_gap
    return {
        **row,
        "target_token": first,
        "runner_up": target_top[j][1][0],
        "gap": gap,
        "verdict": NEAR_TIE if near else MISMATCH,
    }


def _spread(values: list[float]) -> float:
    import statistics

    return statistics.stdev(values) if len(values) > 1 else 0.0


def speed_metrics(draft: dict[str, list[float]], target: dict[str, list[float]]) -> dict[str, Any]:
    """The speed ratio (draft-served over the target alone, warm), at concurrency 1 and at the
    evaluation's batch: each server's median tokens/s over the repeats (a repeat slowed by
    something else on the machine moves a median least), their ratio, and the standard
    deviation of the per-repeat ratios as its spread."""
    import statistics

    out: dict[str, Any] = {}
    for kind in ("c1", "batch"):
        if not draft[kind]:
            continue
        d, t = statistics.median(draft[kind]), statistics.median(target[kind])
        out[f"speedup_{kind}"] = d / t
        ratios = [a / b for a, b in zip(draft[kind], target[kind], strict=True)]
        out[f"speedup_{kind}_std"] = _spread(ratios)
        out[f"draft_tok_s_{kind}"] = d
        out[f"target_tok_s_{kind}"] = t
    return out


def _tokens_per_s(result: dict) -> float:
    return sum(len(t) for t in result["token_ids"]) / result["generate_s"]


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.cfg
    e = cfg.eval
    sets = load_prompt_sets(e)
    first = next(iter(sets))  # the run's own figures (and objective); the others by name
    train_art = ctx.inputs.get("train")  # None for a draft trained elsewhere (eval.draft)
    if train_art is None:
        draft = Path(e.draft or "").expanduser().resolve()
    else:
        draft = train_art.path / "draft"
        # A draft is served only if every byte is what training published (hashed in full: it
        # is small next to the target, and a bit flip would be served silently).
        wrong = damage(train_art, full=True, under="draft/")
        if wrong is not None:
            raise StageError(
                f"the draft in {train_art.path} is damaged ({wrong}); refusing to serve it. Run "
                "with run.force=[train] to train it again, or delete that folder"
            )
    work = ctx.scratch
    logs = work / "logs"  # copied into the artifact at the end; kept in scratch if the stage fails
    ctx.manifest["served"] = {
        "target": ctx.facts.path,
        "draft": str(draft),
        # What a user pastes to serve it as measured (publish rewrites the draft's path).
        "serve_command": shell_command(cfg, ctx.facts.path, server_args(cfg, draft)),
    }
    ctx.manifest["prompt_sets"] = {name: len(p) for name, p in sets.items()}
    existing = cfg.hardware.vllm.endpoint is not None
    comparing = e.compare_target and not existing
    repeats = speed_repeats(cfg) if comparing else 0
    start_s, spec = _serve(cfg, ctx.facts, draft, sets, "draft", logs, speed_repeats=repeats)
    metrics: dict[str, Any] = {"server_start_s": start_s}
    for name, result in spec.items():
        # The first set's figures are the run's own; another set's carry its name as a prefix.
        pre = "" if name == first else f"{name}/"
        measured = acceptance(result["counters"])
        if name != first:
            keep = ("acceptance_length", "draft_acceptance_rate")
            measured = {k: v for k, v in measured.items() if k in keep or "_pos_" in k}
        metrics.update({f"{pre}{k}": v for k, v in measured.items()})
        metrics[f"{pre}prompts"] = len(sets[name])
        metrics[f"{pre}generated_tokens"] = sum(len(t) for t in result["token_ids"])
        metrics[f"{pre}spec_tokens_per_s"] = _tokens_per_s(result)
    identical: dict[str, list[bool | None]] = {n: [None] * len(p) for n, p in sets.items()}
    differs: dict[str, list[dict[str, Any] | None]] = {n: [None] * len(p) for n, p in sets.items()}
    # A server that already runs (hardware.vllm.endpoint) serves one configuration, the draft's:
    # the target alone and a random draft would need servers of their own (the plan says so).
    if existing:
        ctx.manifest["served_by"] = cfg.hardware.vllm.endpoint
    if comparing:
        _, target = _serve(
            cfg, ctx.facts, None, sets, "target", logs, likeliest=True, speed_repeats=repeats
        )
        for name, result in target.items():
            pre = "" if name == first else f"{name}/"
            rows = zip(
                spec[name]["token_ids"], result["token_ids"], result["likeliest"], strict=True
            )
            differs[name] = [divergence(a, b, t2, e.near_tie_gap) for a, b, t2 in rows]
            identical[name] = [d is None for d in differs[name]]
            metrics[f"{pre}target_tokens_per_s"] = _tokens_per_s(result)
        if repeats:
            speeds = {"draft": spec[first]["speed"], "target": target[first]["speed"]}
            (ctx.out / "speed.json").write_text(json.dumps(speeds, indent=1))  # every repeat
            metrics.update(speed_metrics(speeds["draft"], speeds["target"]))
            metrics["speed_repeats"] = repeats
            metrics["speed_batch"] = len(sets[first])
        metrics.update(_identity_counts(differs))
        _report_mismatches(differs)
    if e.random_baseline and not existing and train_art is not None:
        # On the first set only: a floor, not a figure to compare across sets.
        rand = _random_draft(train_art.manifest, work / "random_draft")
        _, rnd = _serve(cfg, ctx.facts, rand, {first: sets[first]}, "random_draft", logs)
        for k, v in acceptance(rnd[first]["counters"]).items():
            metrics[f"random_{k}"] = v
    if train_art is not None:
        train_metrics = train_art.manifest.get("metrics", {})
        metrics.update(teacher_forced(train_metrics, e.num_speculative_tokens))
    identity = [
        {"set": name, "index": i, "prompt": sets[name][i][:200], **d}
        for name in sets
        for i, d in enumerate(differs[name])
        if d is not None
    ]
    (ctx.out / "identity.json").write_text(json.dumps(identity, indent=1))
    table = [
        {
            "set": name,
            "index": i,
            "prompt": p[:300],
            "prompt_tokens": spec[name]["prompt_tokens"][i],
            "new_tokens": len(spec[name]["token_ids"][i]),
            "identical_to_target": identical[name][i],
            "differs": (differs[name][i] or {}).get("verdict"),
            "output": spec[name]["texts"][i],
        }
        for name, prompts in sets.items()
        for i, p in enumerate(prompts)
    ]
    (ctx.out / "eval_table.json").write_text(json.dumps(table, indent=1))
    (ctx.out / "summary.json").write_text(json.dumps(metrics, indent=2))
    if logs.is_dir():  # none with an existing server: its log is on its machine
        shutil.copytree(logs, ctx.out / "logs")
    return metrics


def speed_repeats(cfg: RunnerConfig) -> int:
    """eval.speed_repeats, or its default: 5 on a GPU, none on a CPU (vLLM's CPU build runs
    speculative decoding slower than the target alone: its ratio says nothing about serving)."""
    if cfg.eval.speed_repeats is not None:
        return cfg.eval.speed_repeats
    return 5 if cfg.hardware.device == "cuda" else 0


def _identity_counts(differs: dict[str, list[dict[str, Any] | None]]) -> dict[str, Any]:
    flat = [d for rows in differs.values() for d in rows]
    verdicts = [d["verdict"] for d in flat if d is not None]
    return {
        "identical_to_target_fraction": sum(d is None for d in flat) / len(flat),
        "near_ties": verdicts.count(NEAR_TIE),
        "mismatches": verdicts.count(MISMATCH),
        "undetermined": verdicts.count(UNKNOWN),
    }


def _report_mismatches(differs: dict[str, list[dict[str, Any] | None]]) -> None:
    """An output that leaves the target's greedy path where the target was not near a tie is
    not bf16 noise: the identity check fails, naming the first such prompt (the figures are
    still published, with every divergence in identity.json and MLflow's evaluate/identity
    table, so that each can be looked at)."""
    bad = [
        (name, i, d)
        for name, rows in differs.items()
        for i, d in enumerate(rows)
        if d is not None and d["verdict"] == MISMATCH
    ]
    near = sum(1 for rows in differs.values() for d in rows if d and d["verdict"] == NEAR_TIE)
    if near:
        log.info(
            "[evaluate] %d output(s) leave the target's greedy path at a near tie "
            "(logprob gap <= eval.near_tie_gap): bf16 kernels of another batch shape",
            near,
        )
    if bad:
        name, i, d = bad[0]
        gap = "n/a" if d["gap"] is None else f"{d['gap']:.3f}"
        log.error(
            "[evaluate] identity check FAILED: %d output(s) served with the draft differ from the "
            "target's own where the target was not near a tie; first: set %s, prompt %d, "
            "position %d (target token %s, served %s, logprob gap %s > eval.near_tie_gap). "
            "Speculative decoding must not change greedy output: see identity.json",
            len(bad),
            name,
            i,
            d["position"],
            d["target_token"],
            d["draft_token"],
            gap,
        )


def _set_names(cfg: RunnerConfig) -> list[str]:
    return [prompt_set_name(p) for p in cfg.eval.prompts]


def results(metrics: Mapping[str, Any], cfg: RunnerConfig) -> list[dict[str, Any]]:
    """One row per prompt set: what a published card and a report show. The first set's metrics
    carry no prefix (it is the run's objective), the others "<set>/"."""
    rows = []
    for i, name in enumerate(_set_names(cfg)):
        pre = "" if i == 0 else f"{name}/"
        if f"{pre}acceptance_length" not in metrics:
            continue
        rows.append(
            {
                "set": name,
                "prompts": metrics.get(f"{pre}prompts"),
                "k": cfg.eval.num_speculative_tokens,
                "acceptance_length": metrics[f"{pre}acceptance_length"],
                "per_position": [v for _, v in _positions(metrics, pre)],
                "speedup_c1": metrics.get("speedup_c1") if i == 0 else None,
                "speedup_batch": metrics.get("speedup_batch") if i == 0 else None,
                "random_acceptance_length": (
                    metrics.get("random_acceptance_length") if i == 0 else None
                ),
            }
        )
    return rows


def summary(metrics: dict[str, Any], path: Path, cfg: RunnerConfig) -> list[str]:
    if metrics.get("acceptance_length") is None:
        return []
    same = metrics.get("identical_to_target_fraction")
    lines = []
    for row in results(metrics, cfg):
        per_pos = " / ".join(f"{v:.3f}" for v in row["per_position"])
        lines.append(
            f"acceptance length {row['acceptance_length']:.3f} on {row['set']} (k={row['k']}, "
            f"per position {per_pos}, {row['prompts']} prompts)"
        )
    if "speedup_c1" in metrics:
        lines.append(
            f"speed, warm, draft-served over the target alone ({metrics['speed_repeats']:.0f} "
            f"repeats; ratio of median tokens/s ± sd of the per-repeat ratios): "
            f"{metrics['speedup_c1']:.2f}x ± "
            f"{metrics['speedup_c1_std']:.2f} at concurrency 1, {metrics['speedup_batch']:.2f}x "
            f"± {metrics['speedup_batch_std']:.2f} at batch {metrics['speed_batch']:.0f}"
            + (
                " (on a CPU this ratio says nothing about a GPU: vLLM warns that speculative "
                "decoding on a CPU without Intel OpenMP loses much of its speed)"
                if cfg.hardware.device == "cpu"
                else ""
            )
        )
    extra = []
    if same is not None:
        differ = [
            f"{metrics[k]:.0f} {k.replace('_', ' ')}"
            for k in ("near_ties", "mismatches", "undetermined")
            if metrics.get(k)
        ]
        extra.append(
            f"identical to target: {same:.0%}"
            + (f" (the rest: {', '.join(differ)})" if differ else "")
            + ("; IDENTITY CHECK FAILED (identity.json)" if metrics.get("mismatches") else "")
        )
    if "random_acceptance_length" in metrics:
        extra.append(f"random draft {metrics['random_acceptance_length']:.3f}")
    if "teacher_forced_acceptance_length" in metrics:
        extra.append(f"teacher-forced estimate {metrics['teacher_forced_acceptance_length']:.3f}")
    if extra:
        lines.append(", ".join(extra))
    return [*lines, f"serve it: {serve_command(cfg, path)}"]


def serve_command(cfg: RunnerConfig, path: Path) -> str:
    """The command that serves the target with the evaluated draft on this machine as the
    evaluation did (the same engine flags: dtype, context, and on CPU the memory settings)."""
    try:
        served = json.loads((path / "manifest.json").read_text())["served"]
    except (OSError, ValueError, KeyError):
        return "(see the evaluation's manifest)"
    if "serve_command" in served:
        return served["serve_command"]
    return shell_command(cfg, served["target"], server_args(cfg, Path(served["draft"])))


def _positions(metrics: Mapping[str, Any], pre: str = "") -> list[tuple[int, float]]:
    """(position, acceptance) for every draft position the metrics hold (of the set whose
    prefix is `pre`), in order."""
    prefix = f"{pre}acceptance_pos_"
    found = [(int(k[len(prefix) :]), v) for k, v in metrics.items() if k.startswith(prefix)]
    return sorted(found)


def _other_sets(metrics: Mapping[str, Any]) -> list[str]:
    """The prompt sets after the first, as their metrics name them ("humaneval/...")."""
    return sorted({k.split("/", 1)[0] for k in metrics if k.endswith("/acceptance_length")})


def columns(metrics: Mapping[str, float]) -> dict[str, float | None]:
    return {
        "acceptance_length": metrics.get("acceptance_length"),
        **{f"acc_pos_{i}": v for i, v in _positions(metrics)},
        **{f"al_{name}": metrics.get(f"{name}/acceptance_length") for name in _other_sets(metrics)},
        "teacher_forced_al": metrics.get("teacher_forced_acceptance_length"),
    }


def tables(_metrics: Mapping[str, Any], path: Path) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for name, logged in (("eval_table.json", "prompts.json"), ("identity.json", "identity.json")):
        if (path / name).is_file():
            rows = json.loads((path / name).read_text())
            if rows:
                out[f"evaluate/{logged}"] = rows
    return out


def figures(metrics: Mapping[str, Any], _path: Path) -> dict[str, Any]:
    """Acceptance by draft position, the trained draft against the random one (when measured)
    and the teacher-forced estimate."""
    positions = _positions(metrics)
    if not positions:
        return {}
    import matplotlib  # a second to import; only when a run logs its figures

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = [p for p, _ in positions]
    bars = [("served draft", [v for _, v in positions])]
    bars += [
        (f"served draft, {name}", [v for _, v in _positions(metrics, f"{name}/")])
        for name in _other_sets(metrics)
    ]
    rand = [metrics.get(f"random_acceptance_pos_{p}") for p in xs]
    if all(v is not None for v in rand):
        bars.append(("random draft", rand))
    width = 0.8 / len(bars)
    for j, (label, values) in enumerate(bars):
        offset = (j - (len(bars) - 1) / 2) * width
        ax.bar([x + offset for x in xs[: len(values)]], values, width=width, label=label)
    tf = [metrics.get(f"teacher_forced_full_acc_{p}") for p in xs]
    if all(v is not None for v in tf):
        ax.plot(xs, tf, "k--o", label="teacher-forced estimate")
    ax.set_xticks(xs, [str(x + 1) for x in xs])
    ax.set_xlabel("draft position (share of drafts accepted up to it)")
    ax.set_ylabel("acceptance rate")
    ax.set_title(f"acceptance length {metrics.get('acceptance_length', float('nan')):.3f}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return {"evaluate/acceptance_by_position.png": fig}


def _check_prompt_room(p: Plan, cfg: RunnerConfig, view: PlanView, sets: dict) -> None:
    kwargs = dict(cfg.model.chat_template_kwargs)
    files = [file_stamp(name) for name in cfg.eval.prompts]

    def measure() -> list[Any] | None:
        found = plan_tokenizer(cfg, view.target)
        return None if found is None else _longest_prompt(found[0], sets, kwargs)

    longest = remembered(
        cfg, view.target, "longest_prompt", [kwargs, files, cfg.eval.num_prompts], measure
    )
    if longest is None:
        return
    n, where = longest
    e = cfg.eval
    if n + e.max_new_tokens > e.max_model_len:
        p.error(
            "eval.max_model_len",
            f"{e.max_model_len} cannot hold the longest prompt of {where} ({n} tokens) "
            f"plus eval.max_new_tokens={e.max_new_tokens}; raise it to at least "
            f"{n + e.max_new_tokens}",
        )


def _longest_prompt(tok: Any, sets: dict, kwargs: dict) -> list[Any]:
    longest, where = 0, ""
    for name, prompts in sets.items():
        for prompt in prompts:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": prompt}],
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
                **kwargs,
            )
            n = len(ids["input_ids"] if hasattr(ids, "keys") else ids)
            if n > longest:
                longest, where = n, name
    return [longest, where]


def plan(p: Plan, view: PlanView) -> None:
    cfg = view.cfg
    if view.actions.get("evaluate") != "run":
        return
    if cfg.eval.draft:
        from runner.transfer import packed_reason

        packed = packed_reason(Path(cfg.eval.draft).expanduser())
        if packed:
            p.error("eval.draft", packed)
        elif _draft_content(cfg.eval.draft) is None:
            p.error(
                "eval.draft",
                f"{cfg.eval.draft} holds no draft (config.json and model.safetensors)",
            )
        else:
            p.add("draft", f"{cfg.eval.draft} (trained elsewhere: no teacher-forced estimate)")
        if cfg.eval.random_baseline:
            p.warn(
                "eval.random_baseline",
                "not measured for eval.draft: the random draft is "
                "built from this config's own training command",
            )
    if cfg.hardware.vllm.endpoint:
        skipped = [k for k in ("compare_target", "random_baseline") if getattr(cfg.eval, k)]
        if skipped:
            p.warn(
                ", ".join(f"eval.{k}" for k in skipped),
                "not measured: the server at hardware.vllm.endpoint serves the draft only, and "
                "the target alone or a random draft would need servers of their own",
            )
    # Every prompt file is read now (exists, parses, has the fields), not after training, and
    # its longest prompt plus the answer must fit the servers' context.
    try:
        _check_prompt_room(p, cfg, view, load_prompt_sets(cfg.eval))
    except ConfigError as exc:
        p.error(exc.key, exc.message)
    context = cfg.model.max_context or target_context(view.target.config)
    if context and cfg.eval.max_model_len > context:
        p.error(
            "eval.max_model_len",
            f"{cfg.eval.max_model_len} exceeds the target's context of {context} tokens "
            "(vLLM would refuse it after loading; model.max_context overrides the context)",
        )


STAGE = Stage(
    name="evaluate",
    key_config=key_config,
    run=run,
    upstream=("train",),
    version="1",
    libraries={"vllm": VLLM_DISTS},
    identities=("tokenizer_id", "weights_id"),
    logged={"eval_table.json": "evaluate", "summary.json": "evaluate", "logs": "evaluate/logs"},
    summary=summary,
    columns=columns,
    tables=tables,
    figures=figures,
    server=lambda cfg: ServerNeed(
        DRAFT, cfg.eval.max_model_len, "eval.max_model_len", k=cfg.eval.num_speculative_tokens
    ),
    reads=lambda cfg: () if cfg.eval.draft else ("train",),
    objective="acceptance_length",
    plotted="acceptance_length",
    results=results,
    plan=plan,
)
