"""Stage `prepare`: conversations -> token ids + assistant-only loss mask, with the target's
chat template.

Run alone: `python -m runner run.stages=[prepare]`.
Writes `dataset/` (a `datasets` Arrow folder with input_ids, loss_mask, seq_len, in torch format:
what speculators' trainer reads) and `sample.txt` (the first row with supervised text marked).

Chat templates are pure Python, so a large run tokenises in worker processes (data.num_proc;
null picks one per 1,000 conversations, up to the cores); rows, order and counts are the same as
in one process.

The key holds the data's content (sha256 of each file, or a hub dataset's revision; see
runner/assets/conversations.py), so a file edited in place is prepared again. Every row not used is
counted by reason (malformed, unknown_role, no_assistant_turn, template_mismatch, truncated:
no assistant token left within data.max_seq_len, few_assistant_tokens) in the manifest, MLflow
(prepare/dropped/<reason>) and the summary. The plan reads a local file before anything runs.

Multi-turn conversations give one row each, with every assistant turn supervised. The mask is
taken from render boundaries, as speculators does with vLLM's render endpoint: rendering turns
[:j] with the generation prompt and turns [:j+1] without it brackets assistant turn j. Here the
tokenizer's own `apply_chat_template` renders, so no server is needed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import signal
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Executor, ProcessPoolExecutor
from pathlib import Path
from typing import Any

from runner.assets.chat import (
    TemplateBudgetError,
    cache_dir,
    data_key,
    load_tokenizer,
    render,
    render_text,
    template_kwargs,
    tokenizer_at,
)
from runner.assets.conversations import (
    data_fingerprint,
    hub_problem,
    inspect_local,
    read_conversations,
    usable_count,
)
from runner.assets.mixing import Source, about, interleave, key_of, sources
from runner.assets.plan_tokenizer import plan_tokenizer, remembered
from runner.assets.target_facts import Target, target_context
from runner.core.errors import ConfigError
from runner.core.schema import RunnerConfig
from runner.engine.console import bar_interval
from runner.engine.cpu_speed import cpu_rate
from runner.engine.stage import Plan, PlanView, Stage, StageContext
from runner.processes.process import die_with_parent
from stages.prepare.settings import DataConfig

log = logging.getLogger("runner")


key_config = data_key  # the conversations selected are prepare's key


# One short chat turn: what the plan renders to check the template and measure a turn.
ONE_TURN = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]


class TemplateRefused(ValueError):
    """The chat template raised on a conversation (Jinja's raise_exception, a missing variable):
    the data holds what the template does not take."""


class TemplateMismatch(ValueError):
    """The chat template renders a prefix differently once later turns follow."""


def tokenize_conversation(
    tok: Any, turns: list[dict], max_len: int, kwargs: dict | None = None
) -> tuple[list[int], list[int]]:
    """Token ids and loss mask (1 on assistant tokens) of one conversation, cut at max_len."""
    kwargs = kwargs or {}
    full = render(tok, turns, False, kwargs)
    mask = [0] * len(full)
    for j, turn in enumerate(turns):
        # An opening assistant turn has no prompt to bound it (and templates often add a default
        # system turn only before a user turn); it stays context.
        if turn["role"] != "assistant" or j == 0:
            continue
        prompt = render(tok, turns[:j], True, kwargs)
        if len(prompt) >= max_len:
            break
        upto = render(tok, turns[: j + 1], False, kwargs)
        if upto[: len(prompt)] != prompt or full[: len(upto)] != upto:
            raise TemplateMismatch(f"assistant turn {j} does not extend its prompt's render")
        for i in range(len(prompt), len(upto)):
            mask[i] = 1
    return full[:max_len], mask[:max_len]


# Worker processes: each loads the tokenizer from disk once (a remote-code tokenizer's class
# cannot always be pickled), then tokenises chunks of conversations in the order given.
_worker_tok: Any = None
CHUNK = 64  # conversations a task: big enough to hide the pickling, small enough to stop soon


def _init_worker(
    path: str, trust_remote_code: bool, chat_template: str | None, runner_pid: int
) -> None:
    global _worker_tok
    # A worker dies with the runner, even one killed with -9 (the kernel kills it: nothing else
    # would, and each holds a tokenizer's memory); one whose runner was killed while it started
    # exits here, or it would wait on the pool's queue for good (seen in CI). Ctrl-C reaches the
    # whole foreground group, but only the runner acts on it (it stops the pool).
    if not die_with_parent(signal.SIGKILL, runner_pid):
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_tok = tokenizer_at(path, trust_remote_code, chat_template)


def _tokenize_or_none(
    tok: Any, turns: list[dict], max_len: int, kwargs: dict
) -> tuple[list[int], list[int]] | None:
    """tokenize_conversation, with None for a template mismatch (counted by the caller)."""
    try:
        return tokenize_conversation(tok, turns, max_len, kwargs)
    except TemplateMismatch:
        return None
    except Exception as exc:  # the template refused it: named by the caller, with its source
        roles = ", ".join(t["role"] for t in turns)
        first = next((str(t["content"]) for t in turns if t["role"] == "user"), "")
        raise TemplateRefused(
            f"the one whose first user turn starts {first[:60]!r} (turns: {roles}): "
            f"{type(exc).__name__}: {exc}"
        ) from None


def _tokenize_chunk(chunk: list[list[dict]], max_len: int, kwargs: dict) -> list[Any]:
    return [_tokenize_or_none(_worker_tok, turns, max_len, kwargs) for turns in chunk]


def worker_count(num_proc: int | None, conversations: int) -> int:
    """data.num_proc, or null's pick: one process per 1,000 conversations, up to the cores."""
    if num_proc is not None:
        return num_proc
    return max(1, min(len(os.sched_getaffinity(0)), conversations // 1000))


@dataclasses.dataclass
class Pool:
    executor: Executor
    procs: int

    def close(self, interrupted: bool) -> None:
        """Finished: the workers exit. Interrupted (a signal or an error): they are killed at
        once instead of finishing the chunks in flight (SIGTERM took about 29 s to end a run)."""
        if interrupted:
            # ProcessPoolExecutor has no public way to stop running tasks; its processes are.
            for proc in list((getattr(self.executor, "_processes", None) or {}).values()):
                with contextlib.suppress(Exception):
                    proc.kill()
        self.executor.shutdown(wait=not interrupted, cancel_futures=True)


def tokenizer_pool(
    path: str, trust_remote_code: bool, chat_template: str | None, procs: int
) -> Pool | None:
    """Worker processes for `procs` > 1, each with the tokenizer at `path` (spawned: the
    runner's threads must not be forked)."""
    if procs <= 1:
        return None
    import multiprocessing

    executor = ProcessPoolExecutor(
        max_workers=procs,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(path, trust_remote_code, chat_template, os.getpid()),
    )
    return Pool(executor, procs)


def _tokenized(
    convs: Iterable[list[dict]], tok: Any, max_len: int, kwargs: dict, pool: Pool | None
) -> Iterator[tuple[list[dict], Any]]:
    """(turns, ids and mask or None) for each conversation, in order. With a pool a few chunks
    per process are in flight; the caller stops when it has its rows and the rest is cancelled."""
    if pool is None:
        for turns in convs:
            yield turns, _tokenize_or_none(tok, turns, max_len, kwargs)
        return
    ahead = 2 * pool.procs
    pending: deque = deque()
    it = iter(convs)
    try:
        while True:
            while len(pending) < ahead:
                chunk = [t for _, t in zip(range(CHUNK), it, strict=False)]
                if not chunk:
                    break
                pending.append(
                    (chunk, pool.executor.submit(_tokenize_chunk, chunk, max_len, kwargs))
                )
            if not pending:
                return
            chunk, done = pending.popleft()
            yield from zip(chunk, done.result(), strict=True)
    finally:
        for _, f in pending:
            f.cancel()


def _refusals_named(
    tokenized: Iterator[tuple[list[dict], Any]], src: Source
) -> Iterator[tuple[list[dict], Any]]:
    """`tokenized`, with a conversation the chat template refuses named by its source and its
    first words, and the key to change: one line, nothing published."""
    try:
        yield from tokenized
    except TemplateRefused as exc:
        raise ConfigError(
            "model.chat_template",
            f"the chat template refuses a conversation of {src.cfg.source}, {exc}; give a "
            "template that renders it, or data without it",
        ) from None


def marked_text(tok: Any, ids: list[int], mask: list[int]) -> str:
    """Decode a row with supervised spans wrapped in [[ ]] for a human check of the mask."""
    out, cur, state = [], [], 0
    for t, m in zip(ids, mask, strict=True):
        if m != state and cur:
            text = tok.decode(cur)
            out.append(f"[[{text}]]" if state else text)
            cur = []
        state = m
        cur.append(t)
    if cur:
        text = tok.decode(cur)
        out.append(f"[[{text}]]" if state else text)
    return "".join(out)


def _take(src: Source, tok: Any, kwargs: dict, bar: Any, pool: Pool | None) -> dict[str, Any]:
    """Tokenise `src`'s conversations in order until its quota of usable rows: the rows and the
    counts of what was read, used and dropped."""
    d = src.cfg
    with about(src):
        read = read_conversations(d)
    rows: list[tuple[list[int], list[int]]] = []
    # Rows dropped while reading (read.dropped) and here, by reason.
    dropped = Counter({"template_mismatch": 0, "truncated": 0, "few_assistant_tokens": 0})
    truncated = multi_turn = used = 0
    # Never into the held-out room (a regenerated source holds only what regenerate read).
    turns = src.readable(read.turns)
    tokenized = _refusals_named(_tokenized(turns, tok, d.max_seq_len, kwargs, pool), src)
    for turns, out in tokenized:
        if len(rows) >= src.quota:
            break
        used += 1
        if out is None:
            dropped["template_mismatch"] += 1
            continue
        ids, mask = out
        if sum(mask) < d.min_assistant_tokens and len(ids) == d.max_seq_len:
            dropped["truncated"] += 1  # data.max_seq_len cut off the assistant's answer
            continue
        if sum(mask) < d.min_assistant_tokens:
            dropped["few_assistant_tokens"] += 1
            continue
        truncated += len(ids) == d.max_seq_len
        multi_turn += sum(1 for t in turns if t["role"] == "assistant") > 1
        rows.append((ids, mask))
        bar.update(1)
    tokenized.close()  # cancels what is still queued
    if len(rows) < src.quota:
        room = f", {src.hold_out} kept unread for the held-out set (data.hold_out)"
        log.warning(
            "prepare: only %d usable rows of %d asked from %s (%s): read all %d conversations "
            "it may%s",
            len(rows),
            src.quota,
            src.name,
            src.key,
            len(turns),
            room if src.hold_out else "",
        )
    return {
        "rows": rows,
        "read": read,
        "used": used,
        "truncated": truncated,
        "multi_turn": multi_turn,
        "dropped": {**{r: 0 for r in DROP_REASONS}, **read.dropped, **dropped},
    }


def inputs(metrics: Mapping[str, Any], cfg: RunnerConfig, path: Path) -> list[dict[str, Any]]:
    """The training data as MLflow run inputs: each source by its hub id where it has one, the
    rows it gave, and this artifact's key as the digest; with one source, its prepared rows
    (tokens and supervised tokens of each) as the dataset's rows."""
    mix = sources(cfg.data)
    got = metrics.get("rows_from") or {}
    table = _row_sizes(path) if len(mix) == 1 else []
    return [
        {
            "name": src.name,
            # (data.hub_id names the data when there is one source)
            "source": (src.cfg.hub_id if len(mix) == 1 else None) or src.cfg.source,
            "digest": path.name,
            "context": "training",
            "rows": got.get(src.name, metrics.get("rows") if len(mix) == 1 else None),
            "table": table,
        }
        for src in mix
    ]


def _row_sizes(path: Path) -> list[dict[str, int]]:
    """Each prepared row's tokens and supervised (assistant) tokens, read from the artifact."""
    import numpy as np
    import pyarrow.compute as pc
    from datasets import load_from_disk

    try:
        data = load_from_disk(str(path / "dataset")).data
    except (OSError, ValueError, FileNotFoundError):
        return []
    tokens = data.column("seq_len").to_pylist()
    mask = data.column("loss_mask")
    supervised = np.bincount(
        pc.list_parent_indices(mask).to_numpy(),
        weights=pc.list_flatten(mask).to_numpy(),
        minlength=len(tokens),
    )
    return [
        {"tokens": int(t), "supervised_tokens": int(s)}
        for t, s in zip(tokens, supervised, strict=True)
    ]


def _from_regenerated(mix: list[Any], regenerated: Any) -> list[Any]:
    """With regenerate: the same sources and shares, each read from the target's own
    conversations."""
    if regenerated is None:
        return mix
    return [
        dataclasses.replace(
            src,
            cfg=dataclasses.replace(
                src.cfg,
                source=str(regenerated.path / "regenerated" / f"source_{i}.jsonl"),
                column="conversations",
                split="train",
                revision=None,
                shuffle=False,
            ),
            hold_out=0,  # regenerate left the room out already
        )
        for i, src in enumerate(mix)
    ]


def _write_rows(ctx: StageContext, merged: list[Any], tok: Any) -> dict[str, list]:
    """The rows as a datasets folder (input ids, loss mask, length) and the first one marked in
    sample.txt; returns the rows."""
    import datasets  # slow import: only when the stage runs

    rows: dict[str, list] = {
        "input_ids": [ids for _, (ids, _) in merged],
        "loss_mask": [mask for _, (_, mask) in merged],
        "seq_len": [len(ids) for _, (ids, _) in merged],
    }
    ds = datasets.Dataset.from_dict(
        rows,
        features=datasets.Features(
            {
                "input_ids": datasets.Sequence(datasets.Value("int64")),
                "loss_mask": datasets.Sequence(datasets.Value("int64")),
                "seq_len": datasets.Value("int64"),
            }
        ),
    )
    ds.set_format("torch")
    ds.save_to_disk(str(ctx.out / "dataset"))
    (ctx.out / "sample.txt").write_text(
        marked_text(tok, rows["input_ids"][0], rows["loss_mask"][0])
    )
    return rows


def _record_sources(
    ctx: StageContext, mix: list[Any], taken: list[dict[str, Any]], merged: list[Any]
) -> None:
    """What came from where, in the manifest: per source what was asked, read and kept, and
    each row's source in the dataset's order; the first dropped examples."""
    ctx.manifest["dropped_examples"] = [e for t in taken for e in t["read"].examples][:5]
    ctx.manifest["sources"] = [
        {
            "name": src.name,
            "source": src.cfg.source,
            "split": src.cfg.split,
            "revision": src.cfg.revision,
            "asked": src.quota,
            "rows": len(t["rows"]),
            "rows_read": t["read"].rows_read,
            "conversations_read": t["used"],
            "dropped": {k: v for k, v in t["dropped"].items() if v},
        }
        for src, t in zip(mix, taken, strict=True)
    ]
    ctx.manifest["row_sources"] = [i for i, _ in merged]


def run(ctx: StageContext) -> dict[str, Any]:
    from tqdm import tqdm

    cfg = ctx.cfg.data
    tok = load_tokenizer(ctx.cfg, ctx.facts)
    kwargs = template_kwargs(ctx.cfg)
    mix = sources(cfg)
    mix = _from_regenerated(mix, ctx.inputs.get("regenerate"))
    total = sum(s.quota for s in mix)
    procs = worker_count(cfg.num_proc, total)
    if procs > 1:
        log.info("prepare: tokenising in %d processes (data.num_proc)", procs)
    bar = tqdm(total=total, desc="prepare", unit="row", mininterval=bar_interval())
    model = ctx.cfg.model
    pool = tokenizer_pool(str(ctx.facts.path), model.trust_remote_code, model.chat_template, procs)
    done = False
    try:
        taken = [_take(src, tok, kwargs, bar, pool) for src in mix]
        done = True
    finally:
        if pool is not None:
            pool.close(interrupted=not done)
    bar.close()
    merged = interleave([t["rows"] for t in taken], cfg.seed, cfg.shuffle)
    n = len(merged)
    dropped = Counter()
    for t in taken:
        dropped.update(t["dropped"])
    if n == 0:
        raise ConfigError(
            "data.source" if not cfg.sources else "data.sources",
            f"no usable row: of {sum(t['used'] for t in taken)} conversations tokenised, dropped "
            f"{dict(dropped)} (data.max_seq_len, data.min_assistant_tokens)",
        )
    rows = _write_rows(ctx, merged, tok)
    tokens = sum(rows["seq_len"])
    supervised = sum(sum(m) for m in rows["loss_mask"])
    if n < cfg.num_samples:
        log.warning("prepare: only %d usable rows of data.num_samples=%d", n, cfg.num_samples)
    _record_sources(ctx, mix, taken, merged)
    if any(dropped.values()):
        said = ", ".join(f"{v:,} {k.replace('_', ' ')}" for k, v in dropped.items() if v)
        log.info("prepare: dropped %s", said)
    metrics: dict[str, Any] = {
        "rows": n,
        "rows_read": sum(t["read"].rows_read for t in taken),
        "conversations_read": sum(t["used"] for t in taken),
        "tokens": tokens,
        "assistant_tokens": supervised,
        "assistant_fraction": supervised / tokens,
        "mean_seq_len": tokens / n,
        "truncated_fraction": sum(t["truncated"] for t in taken) / n,
        "multi_turn_fraction": sum(t["multi_turn"] for t in taken) / n,
        "dropped": dict(dropped),
        # data.multimodal=drop_media: image/media parts dropped (their text parts kept).
        "media_parts_dropped": sum(t["read"].media_dropped for t in taken),
        "rows_with_media": sum(t["read"].rows_with_media for t in taken),
    }
    if cfg.sources:
        metrics["rows_from"] = {src.name: len(t["rows"]) for src, t in zip(mix, taken, strict=True)}
    return metrics


# Every reason a row is not used, in the order a row meets them.
DROP_REASONS = (
    "malformed",
    "unknown_role",
    "no_assistant_turn",
    "template_mismatch",
    "truncated",
    "few_assistant_tokens",
)


def plan(p: Plan, view: PlanView) -> None:
    """A local file is read as prepare will read it, before anything runs (cached per content):
    a malformed row or an unusable file is refused here, naming the file and line."""
    if view.actions.get("prepare") != "run":
        return
    mix = sources(view.cfg.data)
    if view.cfg.data.sources:
        p.add(
            "data",
            "mixed: "
            + ", ".join(f"{s.name} {s.quota} rows" for s in mix)
            + f" (shuffled together, seed {view.cfg.data.seed})",
        )
    system = [src for src in mix if _plan_source(p, src, cache_dir(view.cfg))]
    for src in mix:
        _plan_rows(p, view.cfg, view.target, src)
    if system:
        problem = _system_turn_problem(view.cfg, view.target)
        if problem:
            key = "model.chat_template" if view.cfg.model.chat_template else "model.source"
            p.error(
                key,
                f"{system[0].cfg.source} has conversations with a system turn, and the target's "
                f"chat template refuses one ({problem}); give a template that takes a system "
                "turn (model.chat_template), or data without them",
            )


SYSTEM_TURN = [{"role": "system", "content": "Be brief."}, *ONE_TURN]


def first_prompt(turns: list[dict[str, str]]) -> list[dict[str, str]] | None:
    """The turns before the first assistant turn that answers a user turn: the prompt of the
    first answer a row supervises (None: the conversation has none)."""
    for j, turn in enumerate(turns):
        if turn["role"] == "assistant" and j and turns[j - 1]["role"] == "user":
            return turns[:j]
    return None


def fitting_rows(cfg: RunnerConfig, target: Target, src: Source) -> dict[str, int] | None:
    """How many of the conversations `src` may read (all but the held-out room) leave room for
    an answer within data.max_seq_len (at most the quota), counted in prepare's order (so a
    plan pays for about what prepare will read, not for the whole source); regenerate selects
    by the same rule. Remembered per content, tokenizer and settings; None for a hub dataset or
    a tokenizer the plan cannot load."""
    d = src.cfg
    kwargs = template_kwargs(cfg)
    if usable_count(d, cache_dir(cfg)) is None:
        return None  # a hub dataset: prepare learns its size

    # Counted up to a power of two at or above the quota (at least 256) and remembered so: a
    # plan with another data.num_samples below it (run.time_budget sizes it per machine) reads
    # the answer instead of rendering the prompts again (13 s for 1,516 rows on 2 cores).
    upto = max(256, 1 << (src.quota - 1).bit_length())

    def measure() -> dict[str, int] | None:
        found = plan_tokenizer(cfg, target)
        if found is None:
            return None
        tok = found[0]
        room = d.max_seq_len - max(d.min_assistant_tokens, 1)
        convs = src.readable(read_conversations(d).turns)
        fit = 0
        for turns in convs:
            if fit >= upto:
                break
            first = first_prompt(turns)
            if first is None:
                continue
            text = render_text(tok, first, True, kwargs)
            # A token is at least a byte: a prompt of fewer bytes than the room fits unread.
            if len(text.encode()) <= room or len(render(tok, first, True, kwargs)) <= room:
                fit += 1
        return {"fit": fit, "readable": len(convs)}

    parts = [
        data_fingerprint(d, cache_dir(cfg)),
        d.column,
        d.seed,
        d.shuffle,
        d.max_seq_len,
        d.min_assistant_tokens,
        kwargs,
        src.hold_out,
        upto,
    ]
    counted = remembered(cfg, target, "fitting_rows", parts, measure)
    if counted is None:
        return None
    return {"fit": min(int(counted["fit"]), src.quota), "readable": int(counted["readable"])}


def _plan_rows(p: Plan, cfg: RunnerConfig, target: Target, src: Source) -> None:
    """Counts, before anything runs, the rows the source gives at this row length: none is
    refused (prepare would fail), fewer than asked is said (prepare reads every conversation it
    may and trains on what it found)."""
    try:
        counted = fitting_rows(cfg, target, src)
    except TemplateBudgetError as exc:  # a row that makes the template run away
        key = "model.chat_template" if cfg.model.chat_template else "model.source"
        p.error(key, f"{exc}, on a conversation of {src.name}")
        return
    except Exception as exc:  # a template that fails on a row is the template check's to name
        log.debug("prepare: rows not counted (%s)", exc)
        return
    if counted is None or counted["fit"] >= src.quota:
        return
    if counted["readable"] == 0 and src.hold_out:
        p.error(
            "data.hold_out",
            f"all {usable_count(src.cfg, cache_dir(cfg)) or 0:,} usable conversations of "
            f"{src.name} are kept for the held-out set (data.hold_out={src.hold_out}): set "
            "data.hold_out below that, or leave heldout out of eval.prompts",
        )
        return
    room = (
        f" (all but the {src.hold_out} at its end kept for the held-out set, data.hold_out)"
        if src.hold_out
        else ""
    )
    said = (
        f"{src.quota:,} rows asked of {src.name}, but only {counted['fit']:,} of the "
        f"{counted['readable']:,} conversations prepare may read{room} leave room for an answer "
        f"within data.max_seq_len={src.cfg.max_seq_len}"
    )
    lower = f"lower data.min_assistant_tokens={src.cfg.min_assistant_tokens}"
    if counted["fit"] == 0:
        p.error(key_of(src, "data.max_seq_len"), f"{said}: raise data.max_seq_len or {lower}")
    else:
        p.warn(key_of(src, "data.num_samples"), f"{said}: prepare trains on what it finds")


def _system_turn_problem(cfg: RunnerConfig, target: Target) -> str | None:
    """Why the target's chat template cannot render a conversation that opens with a system
    turn, or None (measured once per tokenizer and template)."""
    kwargs = {**cfg.model.chat_template_kwargs, **cfg.data.chat_template_kwargs}

    def measure() -> dict[str, Any] | None:
        found = plan_tokenizer(cfg, target)
        if found is None:
            return None
        try:
            render(found[0], SYSTEM_TURN, False, kwargs)
        except Exception as exc:  # Jinja's raise_exception, a missing variable
            return {"problem": f"{type(exc).__name__}: {exc}"}
        return {"problem": None}

    m = remembered(cfg, target, "system_turn", kwargs, measure)
    return None if m is None else m["problem"]


def _plan_source(p: Plan, src: Source, cache: Path) -> bool:
    """The source's lines in the plan; True where its rows hold a system turn."""
    d = src.cfg
    assert d.source is not None
    key = functools.partial(key_of, src)
    if d.source.startswith(("package:",)):
        return False
    try:
        seen = inspect_local(d, cache)
    except ConfigError as exc:
        p.error(key(exc.key), exc.message)
        return False
    if seen is None:
        problem = hub_problem(d)
        if problem:
            p.error(key("data.source"), f"hub dataset {d.source!r}: {problem}")
            return False
        if not d.revision:
            p.warn(
                key("data.revision"),
                f"hub dataset {d.source} is not pinned: its cached prepare result is reused even "
                "if the dataset changes upstream; set data.revision to a commit",
            )
        return False
    dropped = ", ".join(f"{k} {v}" for k, v in seen["dropped"].items()) or "none"
    p.add(
        "data",
        f"{Path(d.source).name}: {seen['rows']} rows, {seen['usable']} usable, dropped: "
        f"{dropped} (sha256 {seen['sha256'][:12]})",
    )
    if seen["usable"] < src.quota:
        p.warn(
            key("data.num_samples"),
            f"{src.quota} asked but {d.source} has {seen['usable']} usable conversations",
        )
    return bool(seen.get("system_rows"))


def check_target(cfg: RunnerConfig, target: Target) -> None:
    """A row must fit the target's context; the tokenizer the stage will use must load, render
    one chat turn with its template, fit that turn in a row, and not know more tokens than the
    target's embedding table has rows."""
    context = cfg.model.max_context or target_context(target.config)
    if context and cfg.data.max_seq_len > context:
        raise ConfigError(
            "data.max_seq_len",
            f"{cfg.data.max_seq_len} exceeds the target's context of {context} tokens (config.json "
            "max_position_embeddings; model.max_context overrides it)",
        )
    check_tokenizer(cfg, target)


# One chat turn, the least a row must hold.


def check_tokenizer(cfg: RunnerConfig, target: Target) -> None:
    kwargs = {**cfg.model.chat_template_kwargs, **cfg.data.chat_template_kwargs}

    def measure() -> dict[str, Any] | None:
        found = plan_tokenizer(cfg, target)
        return None if found is None else _one_turn(cfg, kwargs, *found)

    m = remembered(cfg, target, "one_turn", kwargs, measure)
    if m is None:
        return
    if cfg.data.max_seq_len < m["one_turn"] + 1:
        raise ConfigError(
            "data.max_seq_len",
            f"{cfg.data.max_seq_len} tokens cannot hold one chat turn: the template renders "
            f"'Hi?' / 'Hello.' in {m['one_turn']} tokens",
        )
    rows = target.facts.vocab_size
    if rows and m["tokens"] > rows:
        raise ConfigError(
            "model.source",
            f"the tokenizer at {m['where']} has {m['tokens']} tokens but the target's embedding "
            f"table has {rows} rows (config.json vocab_size): token ids >= {rows} would crash "
            "the target's forward in extract",
        )


def _one_turn(cfg: RunnerConfig, kwargs: dict, tok: Any, path: Path) -> dict[str, Any]:
    """The tokens one short chat turn renders to, and the tokenizer's size."""
    key = "model.chat_template" if cfg.model.chat_template else "model.source"
    if not tok.chat_template:
        raise ConfigError(
            "model.chat_template", f"the tokenizer at {path} has no chat template; set one"
        )
    try:
        ids = render(tok, ONE_TURN, False, kwargs)
    except Exception as exc:  # Jinja syntax and runtime errors, missing variables
        raise ConfigError(
            key, f"the chat template does not render a conversation ({type(exc).__name__}: {exc})"
        ) from None
    return {"one_turn": len(ids), "tokens": len(tok), "where": str(path)}


def summary(metrics: dict[str, Any], path: Path, _cfg: RunnerConfig) -> list[str]:
    dropped = {k: v for k, v in (metrics.get("dropped") or {}).items() if v}
    what = ", ".join(f"{k} {v}" for k, v in dropped.items()) or "none"
    media = metrics.get("media_parts_dropped")
    kept = (
        f"; {media} media parts dropped from {metrics.get('rows_with_media')} rows" if media else ""
    )
    mixed = metrics.get("rows_from") or {}
    parts = f" ({', '.join(f'{k} {v}' for k, v in mixed.items())})" if mixed else ""
    return [
        f"data: {metrics.get('rows')} rows{parts} of {metrics.get('rows_read')} read; dropped: "
        f"{what}" + kept
    ]


def cpu_seconds(cfg: RunnerConfig, work: Any) -> float:
    """Reading the source, rendering and tokenising `work.rows` conversations on this CPU."""
    r = cpu_rate("prepare")
    return float(r.get("fixed_s", 0.0)) + float(r.get("per_row_s", 0.0)) * work.rows


STAGE = Stage(
    name="prepare",
    # Its settings are the run's `data` section (stages/prepare/settings.py), which regenerate
    # and evaluate read too.
    settings=DataConfig,
    section="data",
    rates=Path(__file__).with_name("rates.yaml"),
    key_config=key_config,
    run=run,
    upstream=("regenerate",),  # only when regenerate is on
    version="2",
    libraries={"transformers": ("transformers",), "datasets": ("datasets",)},
    identities=("tokenizer_id",),
    logged={"sample.txt": "prepare"},
    plan=plan,
    cpu_seconds=cpu_seconds,
    check_target=check_target,
    # The data a published card names: the rows kept.
    results=lambda metrics, cfg: [{"rows": metrics.get("rows")}],
    summary=summary,
    inputs=inputs,
)
