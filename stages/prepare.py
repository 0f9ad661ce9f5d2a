"""Stage `prepare`: conversations -> token ids + assistant-only loss mask, with the target's
chat template.

Run alone: `python -m runner run.stages=[prepare]`.
Writes `dataset/` (a `datasets` Arrow folder with input_ids, loss_mask, seq_len, in torch format:
what speculators' trainer reads) and `sample.txt` (the first row with supervised text marked).

Multi-turn conversations give one row each, with every assistant turn supervised. The mask is
taken from render boundaries, as speculators does with vLLM's render endpoint: rendering turns
[:j] with the generation prompt and turns [:j+1] without it brackets assistant turn j. Here the
tokenizer's own `apply_chat_template` renders, so no server is needed.
"""

from __future__ import annotations

import logging
from typing import Any

from runner.assets import load_conversations
from runner.errors import ConfigError
from runner.schema import RunnerConfig
from runner.stage import Stage, StageContext
from runner.target_facts import ModelFacts

log = logging.getLogger("runner")


def template_kwargs(cfg: RunnerConfig) -> dict[str, Any]:
    """The model's chat-template arguments, with the data's on top."""
    return {**cfg.model.chat_template_kwargs, **cfg.data.chat_template_kwargs}


def key_config(cfg: RunnerConfig, facts: ModelFacts) -> dict[str, Any]:
    d = cfg.data
    return {
        "tokenizer": facts.tokenizer_id,
        "source": d.source,
        "split": d.split,
        "column": d.column,
        "num_samples": d.num_samples,
        "max_seq_len": d.max_seq_len,
        "shuffle": d.shuffle,
        "seed": d.seed,
        "chat_template_kwargs": template_kwargs(cfg),
        "min_assistant_tokens": d.min_assistant_tokens,
    }


class TemplateMismatch(ValueError):
    """The chat template renders a prefix differently once later turns follow."""


def _render(tok: Any, turns: list[dict], gen: bool, kwargs: dict) -> list[int]:
    out = tok.apply_chat_template(
        turns, tokenize=True, add_generation_prompt=gen, return_dict=False, **kwargs
    )
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def tokenize_conversation(
    tok: Any, turns: list[dict], max_len: int, kwargs: dict | None = None
) -> tuple[list[int], list[int]]:
    """Token ids and loss mask (1 on assistant tokens) of one conversation, cut at max_len."""
    kwargs = kwargs or {}
    full = _render(tok, turns, False, kwargs)
    mask = [0] * len(full)
    for j, turn in enumerate(turns):
        # An opening assistant turn has no prompt to bound it (and templates often add a default
        # system turn only before a user turn); it stays context.
        if turn["role"] != "assistant" or j == 0:
            continue
        prompt = _render(tok, turns[:j], True, kwargs)
        if len(prompt) >= max_len:
            break
        upto = _render(tok, turns[: j + 1], False, kwargs)
        if upto[: len(prompt)] != prompt or full[: len(upto)] != upto:
            raise TemplateMismatch(f"assistant turn {j} does not extend its prompt's render")
        for i in range(len(prompt), len(upto)):
            mask[i] = 1
    return full[:max_len], mask[:max_len]


def load_tokenizer(cfg: RunnerConfig, facts: ModelFacts) -> Any:
    from transformers import AutoTokenizer  # slow import: only when the stage runs

    tok = AutoTokenizer.from_pretrained(facts.path, trust_remote_code=cfg.model.trust_remote_code)
    if cfg.model.chat_template:
        tok.chat_template = cfg.model.chat_template
    if not tok.chat_template:
        raise ConfigError(
            "model.chat_template", f"the tokenizer at {facts.path} has no chat template; set one"
        )
    return tok


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


def run(ctx: StageContext) -> dict[str, Any]:
    import datasets  # slow import: only when the stage runs
    from tqdm import tqdm

    cfg = ctx.cfg.data
    tok = load_tokenizer(ctx.cfg, ctx.facts)
    convs = load_conversations(cfg)
    kwargs = template_kwargs(ctx.cfg)
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    skipped = {"template_mismatch": 0, "few_assistant_tokens": 0}
    truncated = multi_turn = used = 0
    bar = tqdm(total=cfg.num_samples, desc="prepare", unit="row")
    for turns in convs:
        if len(rows["input_ids"]) >= cfg.num_samples:
            break
        used += 1
        try:
            ids, mask = tokenize_conversation(tok, turns, cfg.max_seq_len, kwargs)
        except TemplateMismatch:
            skipped["template_mismatch"] += 1
            continue
        if sum(mask) < cfg.min_assistant_tokens:
            skipped["few_assistant_tokens"] += 1
            continue
        truncated += len(ids) == cfg.max_seq_len
        multi_turn += sum(1 for t in turns if t["role"] == "assistant") > 1
        rows["input_ids"].append(ids)
        rows["loss_mask"].append(mask)
        rows["seq_len"].append(len(ids))
        bar.update(1)
    bar.close()
    n = len(rows["input_ids"])
    if n == 0:
        raise ConfigError(
            "data.source", f"no usable row: skipped {skipped} of {used} conversations"
        )
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
    tokens = sum(rows["seq_len"])
    supervised = sum(sum(m) for m in rows["loss_mask"])
    if n < cfg.num_samples:
        log.warning("prepare: only %d usable rows of data.num_samples=%d", n, cfg.num_samples)
    return {
        "rows": n,
        "conversations_read": used,
        "tokens": tokens,
        "assistant_tokens": supervised,
        "assistant_fraction": supervised / tokens,
        "mean_seq_len": tokens / n,
        "truncated_fraction": truncated / n,
        "multi_turn_fraction": multi_turn / n,
        "skipped_template_mismatch": skipped["template_mismatch"],
        "skipped_few_assistant_tokens": skipped["few_assistant_tokens"],
    }


STAGE = Stage(
    name="prepare",
    key_config=key_config,
    run=run,
    version="1",
    libraries={"transformers": ("transformers",), "datasets": ("datasets",)},
    identities=("tokenizer_id",),
    logged={"sample.txt": "prepare"},
)
