"""Stage `vocab`: the draft vocabulary from assistant-token frequencies, with d2t/t2d mappings.

Run alone: `python -m runner run.stages=[vocab]` (needs prepare).
Writes `token_freq.pt` (speculators' counter over loss-masked tokens), `d2t.npy` (draft index ->
target id offset) and `t2d.npy` (bool mask over the target vocab), both built by speculators'
own `build_vocab_mappings_from_distribution`, plus `coverage.json`.
Coverage is the share of assistant tokens in the data whose id is in the draft vocabulary: the
ceiling on how often the draft can propose the right token.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.assets.target_facts import ModelFacts, Target
from runner.core.errors import ConfigError
from runner.core.schema import RunnerConfig
from runner.engine.stage import Stage, StageContext


@dataclass
class VocabSettings:
    """The `vocab` config section (conf/vocab/: default 8k for the CPU default, gpu 32k, which a
    GPU hardware option selects)."""

    # Draft vocabulary: this many of the target's tokens, the most frequent in assistant turns.
    draft_vocab_size: int = 8192

    def check(self) -> None:
        if self.draft_vocab_size < 1:
            raise ConfigError("vocab.draft_vocab_size", f"{self.draft_vocab_size} must be >= 1")


def key_config(cfg: RunnerConfig, facts: ModelFacts) -> dict[str, Any]:
    return {
        "draft_vocab_size": cfg.vocab.draft_vocab_size,
        "target_vocab_size": facts.vocab_size,
        "tokenizer": facts.tokenizer_id,
    }


def run(ctx: StageContext) -> dict[str, Any]:
    # Heavy libraries are imported when the stage runs, so that planning stays fast.
    import datasets
    import numpy as np
    import torch
    from speculators.train.vocab_mapping import (
        build_vocab_mappings_from_distribution,
        save_token_frequency_distribution,
    )

    rows = datasets.load_from_disk(str(ctx.inputs["prepare"].path / "dataset"))
    rows.set_format("torch")
    freq_path = ctx.out / "token_freq.pt"
    save_token_frequency_distribution(rows, freq_path)
    freq: dict[int, int] = torch.load(freq_path, weights_only=True)
    size = ctx.cfg.vocab.draft_vocab_size
    d2t, t2d = build_vocab_mappings_from_distribution(freq, size, ctx.facts.vocab_size)
    np.save(ctx.out / "d2t.npy", d2t.numpy())
    np.save(ctx.out / "t2d.npy", t2d.numpy())
    draft_ids = set((torch.arange(size) + d2t).tolist())
    total = sum(freq.values())
    covered = sum(c for t, c in freq.items() if t in draft_ids)
    coverage = {
        "draft_vocab_size": size,
        "target_vocab_size": ctx.facts.vocab_size,
        "assistant_tokens": total,
        "distinct_assistant_tokens": len(freq),
        "coverage": covered / total if total else 0.0,
        "distinct_covered_fraction": min(size, len(freq)) / len(freq) if freq else 0.0,
    }
    (ctx.out / "coverage.json").write_text(json.dumps(coverage, indent=2))
    return coverage


def check_target(cfg: RunnerConfig, target: Target) -> None:
    size, vocab = cfg.vocab.draft_vocab_size, target.facts.vocab_size
    if size > vocab:
        raise ConfigError(
            "vocab.draft_vocab_size", f"{size} is larger than the target's vocab ({vocab})"
        )


def summary(metrics: dict[str, Any], _path: Path, _cfg: RunnerConfig) -> list[str]:
    if "coverage" not in metrics:  # an artifact made elsewhere (e.g. a benchmark's)
        return []
    return [
        f"draft vocab {metrics['draft_vocab_size']} of {metrics['target_vocab_size']} covers "
        f"{metrics['coverage']:.1%} of assistant tokens"
    ]


def columns(metrics: Mapping[str, float]) -> dict[str, float | None]:
    return {"vocab_coverage": metrics.get("coverage")}


STAGE = Stage(
    name="vocab",
    key_config=key_config,
    run=run,
    upstream=("prepare",),
    version="1",
    libraries={"speculators": ("speculators",)},
    identities=("tokenizer_id",),
    logged={"d2t.npy": "vocab", "t2d.npy": "vocab", "coverage.json": "vocab"},
    summary=summary,
    columns=columns,
    check_target=check_target,
    # A sweep over the draft vocab draws one line per size.
    series=("vocab.draft_vocab_size", "train.draft_vocab_size"),
    settings=VocabSettings,
)
