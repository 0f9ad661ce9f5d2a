"""The regenerate stage's settings: the config section `regenerate` (conf/regenerate/), typed
and checked like every section, owned by the stage (Stage.settings)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from runner.core.errors import ConfigError
from runner.core.ranges import at_least, seed_range


class RegenerateBackend(StrEnum):
    # Train on the data's own responses.
    none = "none"
    # The target rewrites every assistant turn on a vLLM server the runner starts for it.
    vllm = "vllm"
    # In-process transformers generate (small targets, boxes without vLLM).
    transformers = "transformers"


@dataclass
class RegenerateConfig:
    # none, vllm or transformers (stages/regenerate/).
    backend: RegenerateBackend = RegenerateBackend.none
    # 0 = greedy; above 0, sampled with top_p and seed.
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    # Tokens per assistant turn at most; a turn also stops where the row reaches
    # data.max_seq_len (prepare would cut it there anyway).
    max_tokens: int = 512
    # Chat-template arguments for generation and for prepare's rendering of the new rows, on top
    # of the model's and the data's (e.g. {thinking: false} for Kimi-K2.5).
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # The stage fails when more than this share of generations failed or stopped at max_tokens.
    max_bad_fraction: float = 0.1
    # vllm: requests in flight and seconds per request. transformers: prompts per generate call.
    concurrency: int = 64
    request_timeout_s: int = 600
    batch_size: int = 16
    # transformers: its continuous batching (paged KV cache; a finished answer frees its slot at
    # once) instead of padded `generate`, where every row waits for the batch's longest answer.
    # The one for a GPU; on a CPU padded calls measured faster.
    continuous_batching: bool = False

    def check(self) -> None:
        seed_range("regenerate.seed", self.seed)
        if self.temperature < 0:
            raise ConfigError("regenerate.temperature", f"{self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError("regenerate.top_p", f"{self.top_p} must be in (0, 1]")
        for key in ("max_tokens", "concurrency", "request_timeout_s", "batch_size"):
            at_least(f"regenerate.{key}", getattr(self, key), 1)
        if not 0 <= self.max_bad_fraction <= 1:
            raise ConfigError(
                "regenerate.max_bad_fraction", f"{self.max_bad_fraction} must be in [0, 1]"
            )
