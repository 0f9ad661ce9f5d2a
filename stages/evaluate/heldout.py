"""The held-out prompt set (`heldout` in eval.prompts): conversations of the training data's own
source that the draft never trained on, so that acceptance in distribution sits beside MT-bench's
and HumanEval's.

    prompts = heldout_prompts(cfg, n, used, fits)  # the last n conversations, as prompts
    plan_room(plan, cfg)  # in the plan: is there a room, and does it hold eval.num_prompts?

prepare (and regenerate) read the first source's conversations in one shuffled order (data.seed)
from its start until they have their rows, never into its last data.hold_out conversations (the
held-out room); the held-out prompts are the last `n` of that order, never closer to the start
than `consumed`, the conversations read before them. Because the room is kept by construction,
no amount of dropped rows or regeneration can use it up after the plan said yes.

Each prompt is its conversation up to its last user turn, the data's own answers to the earlier
turns included (multi-turn: the context a served draft meets in a chat), or, where that does not
fit the evaluation's context or the chat template refuses it (`fits` says no), up to an earlier
user turn, down to the first user turn alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from runner.assets.conversations import read_conversations
from runner.assets.mixing import sources
from runner.assets.prompts import Prompt
from runner.core.errors import StageError
from runner.core.schema import RunnerConfig

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


def plan_room(p: Any, cfg: RunnerConfig) -> None:
    """In the plan, before anything loads: the held-out set's prompts come from its room (the
    last data.hold_out conversations of the first source's shuffled order, which prepare and
    regenerate never read), so a room of none is refused and one smaller than eval.num_prompts
    gives fewer prompts, said now. (That the rest of the source gives the rows asked is
    prepare's plan's to count.)"""
    if not wanted(cfg):
        return
    room = sources(cfg.data)[0].hold_out
    if room == 0:
        p.error(
            "data.hold_out",
            "0 conversations kept for the held-out set, which eval.prompts names: set "
            f"data.hold_out (e.g. {cfg.eval.num_prompts}, eval.num_prompts; prepare then reads "
            "other conversations: training changes) " + _leave_out(cfg),
        )
    elif room < cfg.eval.num_prompts:
        p.warn(
            "data.hold_out",
            f"the held-out set has room for {room} prompts, fewer than eval.num_prompts="
            f"{cfg.eval.num_prompts}: its interval will be wider",
        )
