"""The held-out prompt set (`heldout` in eval.prompts): conversations of the training data's own
source that the draft never trained on, so that acceptance in distribution sits beside MT-bench's
and HumanEval's.

    prompts = heldout_prompts(cfg, n, used, fits)  # the last n conversations, as prompts
    plan_room(plan, cfg, cache)  # the plan: does data.num_samples leave any? (seconds)
    after_prepare(cfg, name, art)  # once prepare is done: did it leave any? (before training)

prepare (and regenerate) read the first source's conversations in one shuffled order (data.seed)
from its start until they have their rows; the held-out ones are the last `n` of that order,
never closer to the start than `consumed`, the conversations read before them.

Each prompt is its conversation up to its last user turn, the data's own answers to the earlier
turns included (multi-turn: the context a served draft meets in a chat), or, where that does not
fit the evaluation's context or the chat template refuses it (`fits` says no), up to an earlier
user turn, down to the first user turn alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runner.assets.conversations import read_conversations, usable_count
from runner.assets.mixing import sources
from runner.assets.prompts import Prompt
from runner.core.errors import ConfigError, StageError
from runner.core.schema import RunnerConfig
from runner.engine.stage import Plan

log = logging.getLogger("runner")
HELDOUT = "heldout"


def consumed(prepare_manifest: dict, regenerate_metrics: dict | None) -> int:
    """How many of the first source's conversations, in the shuffled order, training may have
    seen: what prepare read, or with regenerate, what regenerate read (the rows it wrote, failed
    or skipped; over all sources: an upper bound for the first)."""
    read = int(prepare_manifest.get("sources", [{}])[0].get("conversations_read", 0))
    if regenerate_metrics is None:
        return read
    skipped = sum((regenerate_metrics.get("skipped") or {}).values())
    regenerated = int(regenerate_metrics.get("conversations", 0))
    return regenerated + int(regenerate_metrics.get("conversations_failed", 0)) + skipped


def candidates(turns: list[dict[str, str]]) -> list[Prompt]:
    """A conversation's prompts, longest first: cut after each of its user turns from the last
    back to the second (messages from the first user turn on), then the first user turn alone."""
    users = [j for j, t in enumerate(turns) if t["role"] == "user" and t["content"].strip()]
    if not users:
        return []
    start = users[0]
    longer: list[Prompt] = [turns[start : j + 1] for j in reversed(users[1:])]
    return [*longer, turns[start]["content"]]


def heldout_prompts(
    cfg: RunnerConfig, n: int, used: int, fits: Callable[[Prompt], bool] = lambda _p: True
) -> list[Prompt]:
    """Up to `n` prompts, from the end of the first source's shuffled order back to `used`, each
    its conversation's longest that `fits` (the evaluation's context and the chat template), in
    that order's direction."""
    first = sources(cfg.data)[0]
    convs = read_conversations(first.cfg).turns
    prompts: list[Prompt] = []
    too_long = 0
    for turns in reversed(convs[used:]):
        if len(prompts) >= n:
            break
        options = candidates(turns)
        if not options:
            continue
        prompt = next((p for p in options if fits(p)), None)
        if prompt is None:
            too_long += 1
            continue
        prompts.append(prompt)
    if not prompts:
        raise StageError(
            f"no conversation of {first.name} is held out: training read {used} of its "
            f"{len(convs)} ({too_long} more too long for eval.max_model_len); lower "
            "data.num_samples or take heldout out of eval.prompts"
        )
    if len(prompts) < n:
        log.warning(
            "[evaluate] only %d held-out conversations of %s (eval.num_prompts=%d): training read "
            "%d of %d, %d too long for eval.max_model_len",
            len(prompts),
            first.name,
            n,
            used,
            len(convs),
            too_long,
        )
    return prompts[::-1]


def wanted(cfg: RunnerConfig) -> bool:
    """The run serves the held-out set: named in eval.prompts, for a draft trained here."""
    return HELDOUT in cfg.eval.prompts and not cfg.eval.draft


def _leave_out(cfg: RunnerConfig) -> str:
    rest = ",".join(s for s in cfg.eval.prompts if s != HELDOUT)
    return f"or leave heldout out (eval.prompts=[{rest}])"


def plan_room(p: Plan, cfg: RunnerConfig, cache: Path) -> None:
    """Before anything runs: an error when data.num_samples leaves none of the first source's
    conversations unread, a warning when it leaves fewer than eval.num_prompts. Known for a
    packaged or local source; a hub dataset's size is learnt by prepare (after_prepare)."""
    if not wanted(cfg):
        return
    first = sources(cfg.data)[0]
    total = usable_count(first.cfg, cache)
    if total is None:
        return
    spare = total - first.quota
    most = max(total - cfg.eval.num_prompts, 0)
    if spare <= 0:
        p.error(
            "eval.prompts",
            f"heldout serves conversations training never read, but data.num_samples="
            f"{first.quota} reads all {total:,} usable conversations of {first.name}; set "
            f"data.num_samples to at most {most:,} ({total:,} less eval.num_prompts="
            f"{cfg.eval.num_prompts}, and prepare reads on past every row it drops), "
            + _leave_out(cfg),
        )
    elif spare < cfg.eval.num_prompts:
        p.warn(
            "eval.prompts",
            f"heldout: data.num_samples={first.quota} leaves {spare} of {first.name}'s {total:,} "
            f"conversations unread, fewer than eval.num_prompts={cfg.eval.num_prompts} (and "
            "fewer still after prepare reads on past the rows it drops)",
        )


def after_prepare(cfg: RunnerConfig, name: str, art: Any) -> None:
    """The evaluate stage's upstream check: once prepare is done, a first source that ran out
    (fewer rows than asked: every conversation read) leaves nothing held out, so the run fails
    now, not after training."""
    if name != "prepare" or not wanted(cfg):
        return
    src = (art.manifest.get("sources") or [{}])[0]
    rows, asked = src.get("rows"), src.get("asked")
    if rows is None or asked is None or rows >= asked:
        return
    raise ConfigError(
        "eval.prompts",
        f"heldout serves conversations training never read, but prepare read every "
        f"conversation of {src.get('name', 'the first source')} ({src.get('conversations_read')}"
        f") and found {rows:,} of the {asked:,} rows asked, so none is left; set "
        f"data.num_samples to at most {max(rows - cfg.eval.num_prompts, 0):,}, "
        + _leave_out(cfg)
        + " (this prepare result is kept for that run)",
    )
