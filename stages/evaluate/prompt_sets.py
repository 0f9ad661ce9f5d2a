"""The evaluation's prompts: eval.prompts by name (packaged sets and files,
runner/assets/sources.py; the
held-out set from the training data, stages/evaluate/heldout.py), each with room for the answer in
eval.max_model_len, and the plan's check that the longest fits.
"""

from __future__ import annotations

import logging
from typing import Any

from runner.assets.chat import load_tokenizer, render, template_kwargs
from runner.assets.plan_tokenizer import file_stamp, plan_tokenizer, remembered
from runner.assets.prompts import Prompt, messages, prompt_set_name, user_turns
from runner.assets.sources import load_prompts
from runner.core.schema import RunnerConfig
from runner.engine.stage import Plan, PlanView, StageContext
from stages.evaluate.heldout import HELDOUT, consumed, heldout_prompts

log = logging.getLogger("runner")


def prompt_sets(ctx: StageContext) -> dict[str, list[Prompt]]:
    """eval.prompts by name; `heldout` from the training data's conversations prepare did not
    read (stages/evaluate/heldout.py), each prompt with room for the answer in
    eval.max_model_len."""
    e = ctx.cfg.eval
    out = {}
    for source in prompt_sources(ctx.cfg):
        if source != HELDOUT:
            out[prompt_set_name(source)] = load_prompts(source, e.num_prompts)
            continue
        regen = ctx.inputs.get("regenerate")
        used = consumed(
            ctx.inputs["prepare"].manifest, regen.manifest.get("metrics") if regen else None
        )
        out[HELDOUT] = heldout_prompts(ctx.cfg, e.num_prompts, used, fits(ctx))
        turns = [user_turns(q) for q in out[HELDOUT]]
        log.info(
            "[evaluate] heldout: %d conversations training never read, %d of them multi-turn "
            "(up to %d user turns)",
            len(turns),
            sum(t > 1 for t in turns),
            max(turns),
        )
    return out


def fits(ctx: StageContext) -> Any:
    """Whether a prompt, in the target's chat template, leaves eval.max_new_tokens of room."""
    e = ctx.cfg.eval
    tok = load_tokenizer(ctx.cfg, ctx.facts)
    return fits_in(tok, template_kwargs(ctx.cfg), e.max_model_len - e.max_new_tokens)


def fits_in(tok: Any, kwargs: dict, room: int) -> Any:
    """Whether a prompt takes at most `room` tokens in `tok`'s chat template; a conversation the
    template refuses (one that allows a single turn, or strict roles) does not fit."""

    def fits(prompt: Prompt) -> bool:
        try:
            return len(render(tok, messages(prompt), True, kwargs)) <= room
        except Exception:  # jinja2's TemplateError, or the template's own raise_exception
            if isinstance(prompt, str):
                raise
            return False

    return fits


def prompt_sources(cfg: RunnerConfig) -> list[str]:
    """eval.prompts, less `heldout` for a draft trained elsewhere (eval.draft): what it was
    trained on is not known here, so nothing is known to be held out from it."""
    return [s for s in cfg.eval.prompts if not (s == HELDOUT and cfg.eval.draft)]


def check_prompt_room(p: Plan, cfg: RunnerConfig, view: PlanView, sets: dict) -> None:
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
            n = len(render(tok, messages(prompt), True, kwargs))
            if n > longest:
                longest, where = n, name
    return [longest, where]
