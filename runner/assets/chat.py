"""The target's chat template, as every stage that renders conversations uses it: its
arguments (`template_kwargs`), one render to token ids (`render`), the tokenizer with its
template (`load_tokenizer`), and the key of the conversations a run selects (`data_key`), which
prepare and regenerate share (regenerate rewrites the very rows prepare will read).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from runner.assets.conversations import data_fingerprint
from runner.assets.mixing import sources
from runner.assets.target_facts import ModelFacts
from runner.core.errors import ConfigError
from runner.core.layout import RunLayout
from runner.core.schema import RunnerConfig


def template_kwargs(cfg: RunnerConfig) -> dict[str, Any]:
    """The model's chat-template arguments, with the data's on top (and regenerate's, when the
    rows are the target's own: rendered as they were generated)."""
    # The regenerate stage's section, where the registry has one (Stage.settings).
    regen = getattr(cfg, "regenerate", None)
    extra = regen.chat_template_kwargs if regen is not None and regen.backend != "none" else {}
    return {**cfg.model.chat_template_kwargs, **cfg.data.chat_template_kwargs, **extra}


def cache_dir(cfg: RunnerConfig) -> Path:
    return RunLayout.at(cfg.run.output_root).cache


def data_key(cfg: RunnerConfig, facts: ModelFacts) -> dict[str, Any]:
    d = cfg.data
    return {
        "tokenizer": facts.tokenizer_id,
        "source": d.source,
        # What the data holds, not only where it is: an edited file gives a new key.
        "data_content": data_fingerprint(d, cache_dir(cfg)) if not d.sources else None,
        "split": d.split,
        "column": d.column,
        "num_samples": d.num_samples,
        "max_seq_len": d.max_seq_len,
        "shuffle": d.shuffle,
        "seed": d.seed,
        "chat_template_kwargs": template_kwargs(cfg),
        "min_assistant_tokens": d.min_assistant_tokens,
        # The held-out room changes what prepare may read (named only when kept: older keys).
        **({"hold_out": d.hold_out} if d.hold_out else {}),
        # Mixed sources: each one's settings, share and content.
        **(
            {
                "sources": [
                    {
                        "name": s.name,
                        "source": s.cfg.source,
                        "split": s.cfg.split,
                        "column": s.cfg.column,
                        "revision": s.cfg.revision,
                        "rows": s.quota,
                        "data_content": data_fingerprint(s.cfg, cache_dir(cfg)),
                    }
                    for s in sources(d)
                ]
            }
            if d.sources
            else {}
        ),
    }


# A chat template is a program (Jinja, sandboxed: no files, ranges of at most 100,000, but
# loops may nest): one conversation must render within this many seconds and tokens, else the
# template is named instead of the runner hanging (a template looping 10^10 times ran past
# 300 s in prepare with no message). A real template renders a conversation in milliseconds.
RENDER_SECONDS_MAX = 10.0
RENDER_TOKENS_MAX = 4_000_000


class TemplateBudgetError(RuntimeError):
    """The chat template ran past its time or output budget on one conversation."""


@contextlib.contextmanager
def _time_budget(seconds: float) -> Iterator[None]:
    """Raises TemplateBudgetError in the block after `seconds` (a real-time timer; only the
    main thread of a process can have one, elsewhere the block runs unbounded)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(_sig: int, _frame: Any) -> None:
        raise TemplateBudgetError(
            f"the chat template did not finish one conversation in {seconds:g} s (a loop that "
            "does not end?)"
        )

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def render_text(tok: Any, turns: list[dict], gen: bool, kwargs: dict) -> str:
    """One conversation as the template writes it, within the template's budget."""
    with _time_budget(RENDER_SECONDS_MAX):
        text = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=gen, **kwargs)
    if len(text) > RENDER_TOKENS_MAX:  # at least a byte a token: no more tokens than this
        raise TemplateBudgetError(
            f"the chat template wrote {len(text):,} characters for one conversation"
        )
    return text


def render(tok: Any, turns: list[dict], gen: bool, kwargs: dict) -> list[int]:
    """One conversation's token ids, within the template's budget."""
    with _time_budget(RENDER_SECONDS_MAX):
        out = tok.apply_chat_template(
            turns, tokenize=True, add_generation_prompt=gen, return_dict=False, **kwargs
        )
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    if len(out) > RENDER_TOKENS_MAX:
        raise TemplateBudgetError(
            f"the chat template wrote {len(out):,} tokens for one conversation"
        )
    return list(out)


def load_tokenizer(cfg: RunnerConfig, facts: ModelFacts) -> Any:
    tok = tokenizer_at(str(facts.path), cfg.model.trust_remote_code, cfg.model.chat_template)
    if not tok.chat_template:
        raise ConfigError(
            "model.chat_template", f"the tokenizer at {facts.path} has no chat template; set one"
        )
    return tok


def tokenizer_at(path: str, trust_remote_code: bool, chat_template: str | None) -> Any:
    from transformers import AutoTokenizer  # slow import: only when the stage runs

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if chat_template:
        tok.chat_template = chat_template
    return tok
