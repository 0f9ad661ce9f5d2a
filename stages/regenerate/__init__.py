"""Stage `regenerate` (optional): the target writes the assistant turns of its training data, so
that the draft learns the target's own distribution rather than another model's.

On with `regenerate=vllm` (a vLLM server the runner starts) or `regenerate=transformers`
(in-process generate, for boxes without vLLM); off (`regenerate=none`) by default.
Run alone: `python -m runner regenerate=vllm run.stages=[regenerate]`.

The conversations are those prepare would read (data.source or each of data.sources, shuffled
with data.seed, each source's share of data.num_samples). Each keeps its system and user turns;
every assistant turn that answers a user turn is generated again by the target, conditioned on
the target's own earlier answers. The prompt is rendered here with the target's chat template
(the ids prepare will train on) and sent as token ids with `return_token_ids`, the field
speculators' `regenerate-responses` reads too; its per-turn rows are not used: prepare renders
whole conversations with every assistant turn supervised, as it does for the original data, so an
A/B of original against regenerated responses changes nothing else. Decoding comes from
`regenerate.*`: greedy (temperature 0) or sampled, max_tokens per turn, and chat-template
arguments, which prepare also renders with (Kimi's thinking mode is explicit).

A turn ends at the target's end of turn, at regenerate.max_tokens (counted as truncated), or
where its row reaches data.max_seq_len: prepare would cut the row there, so later turns are not
generated. A conversation whose first prompt leaves no room for an answer is skipped (prepare
would drop it). Failed generations (an error, an empty answer) and truncated ones are counted; the
stage fails when their share exceeds regenerate.max_bad_fraction.

Writes `regenerated/source_<i>.jsonl`, one line per conversation: `conversations` (the new turns),
`token_ids` (each generated turn's ids, without the end-of-turn token), `finish_reasons`.
Resumable: each conversation is appended to the scratch folder, with its counts, as soon as its
last turn is written, and a rerun after a failure or Ctrl-C generates only the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from runner.assets.chat import data_key, load_tokenizer, render, template_kwargs
from runner.assets.conversations import read_conversations
from runner.assets.mixing import about, sources
from runner.assets.target_facts import ModelFacts
from runner.core.errors import StageError
from runner.core.schema import RunnerConfig
from runner.engine import costs
from runner.engine.console import bar_interval
from runner.engine.stage import GENERATE, Plan, PlanView, ServerNeed, Stage, StageContext
from runner.integrations.versions import VLLM_DISTS
from stages.regenerate.settings import RegenerateConfig

log = logging.getLogger("runner")


def chunk_size(r: Any) -> int:
    """Conversations taken through their turns together (each round asks for one turn of every
    unfinished one): at least 128, and four padded generate batches, one continuous batch, or two
    server loads of requests (vLLM), so that a round keeps the engine busy. A conversation is
    saved as soon as it is finished: a stop loses the round in flight, not the chunk."""
    if r.backend != "transformers":
        return max(128, 2 * r.concurrency)
    return max(128, r.batch_size if r.continuous_batching else 4 * r.batch_size)


def enabled(cfg: RunnerConfig) -> bool:
    return cfg.regenerate.backend != "none"


def key_config(cfg: RunnerConfig, facts: ModelFacts) -> dict[str, Any]:
    r = cfg.regenerate
    data = data_key(cfg, facts)  # the conversations read are prepare's own selection
    return {
        "weights": facts.weights_id,
        "data": {k: v for k, v in data.items() if k != "tokenizer"},
        # Greedy output is the target's, but kernels differ: each backend is its own result.
        "backend": r.backend,
        "temperature": r.temperature,
        "top_p": r.top_p if r.temperature > 0 else None,
        "seed": r.seed if r.temperature > 0 else None,
        "max_tokens": r.max_tokens,
        "chat_template_kwargs": template_kwargs(cfg),
        "dtype": cfg.hardware.dtype,
        # Paged attention's kernels differ again (named only when on: older keys stay valid).
        **({"continuous_batching": True} if r.continuous_batching else {}),
        # vLLM's kernel, KV cache dtype, flags and variables change its greedy output too
        # (unset: as before).
        **(cfg.hardware.server_key(target_only=True) if r.backend == "vllm" else {}),
    }


@dataclasses.dataclass
class Generated:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (end of turn) or "length"


@dataclasses.dataclass
class Job:
    """One conversation on its way: the turns written so far and the original ones still to go."""

    index: int
    source: int
    pending: list[dict[str, str]]
    turns: list[dict[str, str]] = dataclasses.field(default_factory=list)
    token_ids: list[list[int]] = dataclasses.field(default_factory=list)
    finish: list[str] = dataclasses.field(default_factory=list)
    done: bool = False
    failed: str | None = None
    # This conversation's generations, failures and cuts: saved with it, so that a rerun that
    # keeps it also keeps its counts.
    counts: Counter = dataclasses.field(default_factory=Counter)

    def next_prompt(self) -> list[dict[str, str]] | None:
        """Copy original turns up to the next assistant turn that answers a user turn; the
        messages to generate it from (None: nothing left to generate)."""
        while self.pending:
            turn = self.pending.pop(0)
            answers_user = bool(self.turns) and self.turns[-1]["role"] == "user"
            if turn["role"] == "assistant" and answers_user:
                return list(self.turns)
            self.turns.append(turn)
        return None

    def record(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "source": self.source,
            "conversations": self.turns,
            "token_ids": self.token_ids,
            "finish_reasons": self.finish,
            "counts": dict(self.counts),
        }


class TransformersGenerator:
    """Batched `generate` in this process, on hardware.device in hardware.dtype."""

    def __init__(self, cfg: RunnerConfig, facts: ModelFacts, tok: Any):
        import torch

        from runner.assets.loading import load_target

        hw = cfg.hardware
        self.torch = torch
        self.model = load_target(facts.path, getattr(torch, hw.dtype), cfg.model.trust_remote_code)
        self.device = torch.device("cuda" if hw.device == "cuda" else "cpu")
        self.model = self.model.to(self.device).eval()
        self.tok = tok
        self.cfg = cfg.regenerate
        self.eos = _end_ids(tok, self.model)
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else next(iter(self.eos))

    def generate(self, prompts: list[list[int]], limits: list[int]) -> list[Generated | Exception]:
        r = self.cfg
        out: list[Generated | Exception] = [RuntimeError("not generated")] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        for start in range(0, len(order), r.batch_size):
            batch = order[start : start + r.batch_size]
            if r.temperature > 0:
                self.torch.manual_seed(r.seed + start)
            make = self._continuous if r.continuous_batching else self._padded
            made = make([prompts[i] for i in batch], max(limits[i] for i in batch))
            for i, new in zip(batch, made, strict=True):
                out[i] = new if isinstance(new, Exception) else self._finish(new[: limits[i]])
        return out

    def _finish(self, new: list[int]) -> Generated:
        end = next((j for j, t in enumerate(new) if t in self.eos), None)
        if end is not None:
            new, reason = new[:end], "stop"
        else:
            reason = "length"
        return Generated(new, self.tok.decode(new, skip_special_tokens=True), reason)

    def _settings(self, max_new: int) -> dict[str, Any]:
        r = self.cfg
        sampled = r.temperature > 0
        return dict(
            max_new_tokens=max_new,
            do_sample=sampled,
            temperature=r.temperature if sampled else None,
            top_p=r.top_p if sampled else None,
            top_k=None,
            eos_token_id=sorted(self.eos),
            pad_token_id=self.pad,
        )

    def _padded(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding: every prompt ends at the same column
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.inference_mode():
            gen = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                **self._settings(max_new),
            )
        return [gen[row, width:].tolist() for row in range(len(prompts))]

    def _continuous(self, prompts: list[list[int]], max_new: int) -> list[Any]:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        # The paged cache sized to what this batch can fill, every answer at its longest: left to
        # itself transformers takes 90% of the free device memory, and on a CPU that is the
        # machine's RAM (20 GiB for a 4-layer test model, and the OOM killer).
        page = 256
        blocks = len(prompts) * -(-(max(map(len, prompts)) + max_new) // page)
        batching = ContinuousBatchingConfig(
            page_size=page, num_blocks=blocks, max_requests_per_batch=len(prompts)
        )
        # Not under inference_mode: the batcher's own thread updates tensors made here.
        results = self.model.generate_batch(
            inputs=prompts,
            generation_config=GenerationConfig(**self._settings(max_new)),
            continuous_batching_config=batching,
        )
        # Results come keyed by request id, in the order the prompts were added.
        made = list(results.values())
        if len(made) != len(prompts):
            return [
                RuntimeError(f"continuous batching returned {len(made)} of {len(prompts)}")
            ] * len(prompts)
        return [
            RuntimeError(str(m.error)) if getattr(m, "error", None) else list(m.generated_tokens)
            for m in made
        ]

    def close(self) -> None:
        del self.model
        if self.device.type == "cuda":  # the stages after this one load their own models
            self.torch.cuda.empty_cache()


class VllmGenerator:
    """Chat completions on the vLLM servers the runner starts (hardware.vllm.data_parallel of
    them, each on its own GPUs), `concurrency` requests in flight on each: a request takes a
    free slot of any server, so a faster server answers more."""

    def __init__(self, cfg: RunnerConfig, facts: ModelFacts, tok: Any, logs: Path):
        from runner.serving.server_pool import serve_pool
        from runner.serving.vllm_server import engine_args

        self.cfg = cfg
        self.tok = tok
        self.eos = _end_ids(tok, None)
        args = engine_args(cfg, cfg.data.max_seq_len)
        self._stack = contextlib.ExitStack()
        self.servers = self._stack.enter_context(
            serve_pool(cfg, facts.path, lambda _k: args, logs, "regenerate", existing=False)
        )

    def generate(self, prompts: list[list[int]], limits: list[int]) -> list[Generated | Exception]:
        from runner.serving.vllm_server import quiet_http_logs

        with quiet_http_logs():
            return asyncio.run(self._all(prompts, limits))

    async def _all(self, prompts: list[list[int]], limits: list[int]) -> list[Any]:
        import openai

        r = self.cfg.regenerate
        slots: asyncio.Queue[int] = asyncio.Queue()
        for _ in range(r.concurrency):
            for k in range(len(self.servers)):
                slots.put_nowait(k)
        clients = [
            openai.AsyncOpenAI(
                base_url=s.url, api_key="EMPTY", max_retries=2, timeout=r.request_timeout_s
            )
            for s in self.servers
        ]

        async def one(prompt: list[int], limit: int) -> Generated | Exception:
            # The prompt goes as token ids (the chat template already applied, exactly as
            # prepare will render it), through the completions API.
            k = await slots.get()
            server = self.servers[k]
            try:
                resp = await clients[k].completions.create(
                    model=server.model_id,
                    prompt=prompt,
                    max_tokens=limit,
                    temperature=r.temperature,
                    top_p=r.top_p,
                    seed=r.seed,
                    extra_body={"return_token_ids": True, "skip_special_tokens": True},
                )
            except Exception as exc:
                server.check_alive()
                return exc
            finally:
                slots.put_nowait(k)
            choice = resp.choices[0]
            ids = list(getattr(choice, "token_ids", None) or [])
            if not ids and choice.text:
                return RuntimeError("vLLM returned no token ids (return_token_ids)")
            if ids and ids[-1] in self.eos:
                ids = ids[:-1]
            reason = "length" if choice.finish_reason == "length" else "stop"
            return Generated(ids, choice.text, reason)

        try:
            return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, limits, strict=True)))
        finally:
            for c in clients:
                await c.close()

    def close(self) -> None:
        self._stack.close()


def _end_ids(tok: Any, model: Any) -> set[int]:
    """Token ids that end an assistant turn: the tokenizer's eos, the model's generation eos."""
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen if isinstance(gen, list) else [gen] if gen is not None else [])
    return ids


def _render(tok: Any, turns: list[dict[str, str]], kwargs: dict[str, Any]) -> list[int]:
    """The prompt ids for the next answer: prepare's own rendering, with the generation prompt."""
    return render(tok, turns, True, kwargs)


def _select(cfg: RunnerConfig, tok: Any, kwargs: dict[str, Any]) -> tuple[list[Job], Counter]:
    """Each source's conversations in prepare's order, as many as its share, skipping those whose
    first prompt leaves no room for an answer within data.max_seq_len."""
    d = cfg.data
    jobs: list[Job] = []
    skipped: Counter = Counter()
    for i, src in enumerate(sources(d)):
        with about(src):
            convs = src.readable(read_conversations(src.cfg).turns)  # never the held-out room
        taken = 0
        for turns in convs:
            if taken >= src.quota:
                break
            job = Job(index=len(jobs), source=i, pending=[dict(t) for t in turns])
            first = Job(0, 0, [dict(t) for t in turns]).next_prompt()
            if first is None:
                skipped["no_assistant_turn"] += 1
                continue
            if len(_render(tok, first, kwargs)) > d.max_seq_len - max(d.min_assistant_tokens, 1):
                skipped["prompt_too_long"] += 1
                continue
            jobs.append(job)
            taken += 1
        if taken < src.quota:
            log.warning(
                "[regenerate] only %d conversations of %d asked from %s", taken, src.quota, src.name
            )
    return jobs, skipped


def _run_chunk(jobs: list[Job], gen: Any, tok: Any, cfg: RunnerConfig) -> Iterator[list[Job]]:
    """Generate every remaining assistant turn of `jobs`, one turn of every conversation a round;
    after each round, the conversations it finished."""
    r, d = cfg.regenerate, cfg.data
    kwargs = template_kwargs(cfg)
    while True:
        asks: list[tuple[Job, list[int], int]] = []
        finished: list[Job] = []
        for job in jobs:
            if job.done:
                continue
            messages = job.next_prompt()
            if messages is None:
                job.done = True
                finished.append(job)
                continue
            prompt = _render(tok, messages, kwargs)
            room = d.max_seq_len - len(prompt)
            if room < 1:  # prepare cuts the row before this turn: nothing to generate
                job.counts["stopped_at_max_seq_len"] += 1
                job.done = True
                finished.append(job)
                continue
            asks.append((job, prompt, min(r.max_tokens, room)))
        if not asks:
            if finished:
                yield finished
            return
        results = gen.generate([a[1] for a in asks], [a[2] for a in asks])
        for (job, _prompt, limit), res in zip(asks, results, strict=True):
            job.counts["generations"] += 1
            if isinstance(res, Exception) or not res.text.strip():
                job.counts["failed"] += 1
                job.failed = (
                    f"{type(res).__name__}: {res}" if isinstance(res, Exception) else "empty"
                )
                job.done = True
                finished.append(job)
                continue
            job.turns.append({"role": "assistant", "content": res.text})
            job.token_ids.append(res.token_ids)
            job.finish.append(res.finish_reason)
            job.counts["generated_tokens"] += len(res.token_ids)
            if res.finish_reason == "length":
                job.done = True  # the row is full, or the answer was cut at max_tokens
                job.counts["truncated" if limit == r.max_tokens else "stopped_at_max_seq_len"] += 1
                finished.append(job)
        yield finished


def _resume(partial: Path, done: dict[int, dict[str, Any]], stats: Counter, jobs: int) -> None:
    """A rerun: every complete line of the partial file is a finished conversation (into `done`,
    its counts into `stats`); a line cut by the stop is redone."""
    if not partial.is_file():
        return
    for line in partial.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            break  # a line cut by the stop; its conversation is redone
        done[rec["index"]] = rec
        stats.update(rec.get("counts", {}))
    log.info("[regenerate] resuming: %d of %d conversations already written", len(done), jobs)


def _write_sources(ctx: StageContext, done: dict[int, dict[str, Any]]) -> list[str]:
    """The regenerated conversations, one file per data source in the source's order (what
    prepare reads), with the servers' logs; returns the sources' names."""
    out = ctx.out / "regenerated"
    out.mkdir()
    if (ctx.scratch / "logs").is_dir():  # the servers' logs, kept with the answers they gave
        shutil.copytree(ctx.scratch / "logs", ctx.out / "logs")
    names = [s.name for s in sources(ctx.cfg.data)]
    for i, _name in enumerate(names):
        with (out / f"source_{i}.jsonl").open("w") as fh:
            for rec in sorted(done.values(), key=lambda x: x["index"]):
                if rec["source"] == i:
                    fh.write(json.dumps({k: v for k, v in rec.items() if k != "counts"}) + "\n")
    return names


def run(ctx: StageContext) -> dict[str, Any]:
    from tqdm import tqdm

    cfg = ctx.cfg
    r = cfg.regenerate
    tok = load_tokenizer(cfg, ctx.facts)
    kwargs = template_kwargs(cfg)
    jobs, skipped = _select(cfg, tok, kwargs)
    if not jobs:
        raise StageError("regenerate: no conversation to regenerate (see data.max_seq_len)")
    partial = ctx.scratch / "regenerated.partial.jsonl"
    done: dict[int, dict[str, Any]] = {}
    stats: Counter = Counter()
    _resume(partial, done, stats, len(jobs))
    todo = [j for j in jobs if j.index not in done]
    failures: list[str] = []
    t0 = time.time()
    bar = tqdm(
        total=len(jobs),
        initial=len(done),
        desc="regenerate",
        unit="conv",
        mininterval=bar_interval(),
    )
    gen: Any = None
    try:
        if todo:
            if r.backend == "vllm":
                gen = VllmGenerator(cfg, ctx.facts, tok, ctx.scratch / "logs")
            else:
                gen = TransformersGenerator(cfg, ctx.facts, tok)
        size = chunk_size(r)
        with partial.open("a") as fh:
            for start in range(0, len(todo), size):
                for finished in _run_chunk(todo[start : start + size], gen, tok, cfg):
                    for job in finished:
                        stats.update(job.counts)
                        if job.token_ids:  # at least one answer of the target's own
                            rec = job.record()
                            fh.write(json.dumps(rec) + "\n")
                            done[job.index] = rec
                        else:  # not saved: a rerun tries it again
                            stats["conversations_failed"] += 1
                            if len(failures) < 5:
                                failures.append(f"conversation {job.index}: {job.failed}")
                    fh.flush()
                    bar.update(len(finished))
    finally:
        bar.close()
        if gen is not None:
            gen.close()
    seconds = time.time() - t0
    generations = stats["generations"]
    bad = stats["failed"] + stats["truncated"]
    if generations and bad / generations > r.max_bad_fraction:
        raise StageError(
            f"regenerate: {stats['failed']} failed and {stats['truncated']} truncated of "
            f"{generations} generations ({bad / generations:.1%}) exceeds "
            f"regenerate.max_bad_fraction={r.max_bad_fraction}; raise regenerate.max_tokens if "
            f"answers are cut, or see {ctx.scratch / 'logs'} (first failures: {failures or '-'})"
        )
    names = _write_sources(ctx, done)
    ctx.manifest["sources"] = {f"source_{i}": n for i, n in enumerate(names)}
    ctx.manifest["first_failures"] = failures
    metrics = {
        "conversations": len(done),
        "conversations_failed": stats["conversations_failed"],
        "generations": generations,
        "failed": stats["failed"],
        "truncated": stats["truncated"],
        "stopped_at_max_seq_len": stats["stopped_at_max_seq_len"],
        "generated_tokens": stats["generated_tokens"],
        "tokens_per_s": stats["generated_tokens"] / seconds if seconds > 0 else 0.0,
        "regenerate_s": seconds,
        "skipped": dict(skipped),
    }
    if generations:
        metrics["bad_fraction"] = bad / generations
    log.info("[regenerate] %s", counts_line(metrics, ctx.cfg))
    return metrics


def cost(view: PlanView) -> costs.Cost | None:
    """Regeneration's wall time and GPU-hours: this store's last regeneration on this hardware
    (its seconds a conversation, server start included) times data.num_samples; None without
    one. No shipped rate: the only GPU regeneration measured (the GPU lane's 64 conversations
    beside three other processes) says nothing of a server alone at scale."""
    cfg = view.cfg
    art = costs.measured(view, "regenerate")
    m = (art.manifest.get("metrics") or {}) if art is not None else {}
    if not (m.get("conversations") and m.get("regenerate_s")):
        return None
    per = float(m["regenerate_s"]) / float(m["conversations"])
    wall = per * cfg.data.num_samples
    return costs.Cost(
        "regeneration",
        wall,
        wall * cfg.hardware.num_gpus / 3600,
        f"{cfg.data.num_samples} conversations at {per:.2f} s each [measured by regeneration "
        f"{art.key} in this store: {m['conversations']} conversations in "
        f"{costs.fmt_hours(float(m['regenerate_s']))}]",
        m["conversations"] < cfg.data.num_samples / 10,  # a small run's rate: start-up weighs
    )


def plan(p: Plan, view: PlanView) -> None:
    cfg = view.cfg
    if view.actions.get("regenerate") != "run":
        return
    if cfg.hardware.device == "cuda" and cfg.hardware.gpu_kind:
        if estimate := cost(view):
            p.add_cost("regenerate", estimate, estimate)  # one server: more boxes change nothing
        else:
            p.add(
                "cost: regenerate",
                "no estimate, and not in the total below: no regeneration finished on this "
                "hardware in this store yet (its first run gives the rate; a run of "
                "data.num_samples=200 measures it in minutes)",
            )
    r = cfg.regenerate
    mode = "greedy" if r.temperature == 0 else f"sampled (T={r.temperature}, top_p={r.top_p})"
    p.add(
        "regenerate",
        f"the target rewrites the assistant turns of {cfg.data.num_samples} conversations with "
        f"{r.backend}: {mode}, up to {r.max_tokens} tokens a turn within data.max_seq_len="
        f"{cfg.data.max_seq_len}; chat template {template_kwargs(cfg) or '{}'}",
    )


def summary(metrics: dict[str, Any], _path: Path, cfg: RunnerConfig) -> list[str]:
    if "conversations" not in metrics:
        return []
    return [counts_line(metrics, cfg)]


def counts_line(metrics: dict[str, Any], cfg: RunnerConfig) -> str:
    """What regeneration did, in one line: printed when the stage ends and in the summary."""
    rate = metrics.get("tokens_per_s") or 0.0
    return (
        f"regenerated {metrics['conversations']:,} conversations ({metrics['generations']:,} "
        f"turns, {metrics['generated_tokens']:,} tokens, {rate:,.0f} tokens/s, "
        f"{metrics['regenerate_s'] / 60:.1f} min with {cfg.regenerate.backend}); "
        f"{metrics.get('conversations_failed', 0):,} conversations failed, "
        f"{metrics['failed']:,} turns failed, {metrics['truncated']:,} turns stopped at "
        f"regenerate.max_tokens={cfg.regenerate.max_tokens}, "
        f"{metrics.get('stopped_at_max_seq_len', 0):,} at data.max_seq_len"
    )


STAGE = Stage(
    name="regenerate",
    key_config=key_config,
    run=run,
    version="1",
    libraries={"transformers": ("transformers",), "vllm": VLLM_DISTS},
    identities=("tokenizer_id", "weights_id"),
    plan=plan,
    summary=summary,
    logged={"logs": "regenerate/logs"},
    server=lambda cfg: (
        ServerNeed(GENERATE, cfg.data.max_seq_len, "data.max_seq_len", key="regenerate.backend")
        if cfg.regenerate.backend == "vllm"
        else None
    ),
    resumable=True,
    enabled=enabled,
    settings=RegenerateConfig,
)
