"""Conversations for the prepare stage: read row by row, checked, counted and fingerprinted.

- `read_conversations(cfg.data)` returns `Conversations`: the usable conversations as lists of
  {role, content} turns (shuffled with data.seed), how many rows were read, and every dropped
  row counted by reason. A malformed row (bad JSON, invalid UTF-8, a conversation that is not a
  list of role/content turns) stops the run naming the file and line, unless
  `data.on_bad_row=skip`; rows with an unknown role or no assistant turn are dropped and counted.
  An empty file, or one with no usable row, is an error naming `data.source`.
- `data_fingerprint(cfg.data, cache_dir)` is what the prepare key holds about the data: the
  sha256 and size of every local or packaged file (streamed; remembered per path, size, mtime,
  ctime and inode in `<cache_dir>/data_files.json`, so a warm plan does not hash again, while an
  edit that keeps size and mtime still changes the inode or ctime), or a hub dataset's
  revision. Editing a file in place therefore gives prepare a new key.
- `inspect_local(cfg.data, cache_dir)` reads a local file as prepare would, before any stage
  runs, so the plan refuses a broken file in seconds; remembered per content and column.

Each takes a `ConversationSource`: the fields of the data section (stages/prepare/settings.py,
which runner/ does not import) that reading a source needs; `SourceSettings` is one built here.

Sources: "package:<module>" (the packaged ShareGPT, whose JSON file is cut short on purpose:
complete records are recovered), a local .jsonl / .json / .parquet file, or a hub dataset id.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from runner.core.errors import ConfigError
from runner.core.packages import PACKAGE_PREFIX, package_dir


class ConversationSource(Protocol):
    """What reading one source takes: the data section's fields of the same names."""

    name: str
    source: str | None
    split: str
    column: str | None
    revision: str | None
    shuffle: bool
    seed: int
    # fail | skip; refuse | drop_media (data.on_bad_row, data.multimodal)
    on_bad_row: str
    multimodal: str


@dataclass(frozen=True)
class SourceSettings:
    """A source read outside a run (the stand-in tokenizer's texts), with data's defaults."""

    name: str
    source: str
    split: str = "train"
    column: str | None = None
    revision: str | None = None
    shuffle: bool = True
    seed: int = 0
    on_bad_row: str = "fail"
    multimodal: str = "refuse"


ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
    "model": "assistant",
}
CONVERSATION_FIELDS = ("conversations", "messages", "conversation")
LOCAL_SUFFIXES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
_LOCAL_PREFIXES = ("/", "./", "../", "~")
# Reasons a row is dropped before tokenisation (prepare adds its own after it).
MALFORMED, UNKNOWN_ROLE, NO_ASSISTANT = "malformed", "unknown_role", "no_assistant_turn"
# A row with media parts under data.multimodal=refuse (counted, then the run stops naming it).
MULTIMODAL = "multimodal"
_TEXT_PARTS = ("text", "input_text", "output_text")
# Bumped when what the fingerprint or the inspection holds changes.
_CACHE_VERSION = 1


class _Bad(ValueError):
    """A malformed row, with where it is."""


def _text_of(content: Any) -> tuple[str | None, int]:
    """(the text, media parts) of a turn's content: a string, or a list of OpenAI-style parts
    ({"type": "text", "text": ...}, {"type": "image_url", ...}, ...). None: not readable."""
    if isinstance(content, str):
        return content, 0
    if not isinstance(content, list):
        return None, 0
    texts, media = [], 0
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") in _TEXT_PARTS:
            texts.append(str(part.get("text", "")))
        elif isinstance(part, dict) and part.get("type"):
            media += 1
        else:
            return None, 0
    return "\n".join(t for t in texts if t), media


def classify_turns(
    turns: Any, drop_media: bool = False
) -> tuple[list[dict[str, str]] | None, str | None, str, int]:
    """(normalised turns, None, "", media parts dropped) for a usable conversation, else (None,
    reason, detail, 0). ShareGPT {from, value} and OpenAI {role, content} turns both become
    {role, content}; content given as parts keeps its text parts, and its media parts (images,
    audio, video) make the row MULTIMODAL unless `drop_media`."""
    if not isinstance(turns, list):
        return (
            None,
            MALFORMED,
            f"the conversation is a {type(turns).__name__}, not a list of turns",
            0,
        )
    if not turns:
        return None, NO_ASSISTANT, "an empty conversation", 0
    out, media = [], 0
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return None, MALFORMED, f"turn {i} is a {type(turn).__name__}, not a record", 0
        raw_role = turn.get("role", turn.get("from"))
        content, parts = _text_of(turn.get("content", turn.get("value")))
        if raw_role is None or content is None:
            return None, MALFORMED, f"turn {i} lacks a role/from or a text content/value", 0
        if parts and not drop_media:
            return None, MULTIMODAL, f"turn {i} has {parts} image/media part(s)", 0
        media += parts
        role = ROLE_MAP.get(str(raw_role).lower())
        if role is None:
            return None, UNKNOWN_ROLE, f"turn {i} has role {raw_role!r}", 0
        out.append({"role": role, "content": content})
    if not any(t["role"] == "assistant" and t["content"].strip() for t in out):
        return None, NO_ASSISTANT, "no assistant turn with text", 0
    return out, None, "", media


def normalise_turns(turns: Any) -> list[dict[str, str]] | None:
    """The normalised turns of a usable conversation, else None."""
    return classify_turns(turns)[0]


def iter_truncated_json_array(text: str) -> Iterator[Any]:
    """Yield the complete elements of a JSON array whose text may be cut off mid-element."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except (json.JSONDecodeError, RecursionError):
            return  # the cut-off tail
        yield obj


# ---------------------------------------------------------------------------------------------
# Rows, each with where it came from
# ---------------------------------------------------------------------------------------------


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(file:line, row), or (file:line, _Bad) for a line that is not a JSON record."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield where, _Bad(f"invalid UTF-8 at byte {exc.start} of the line")
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                row = _Bad(f"not JSON ({exc.msg} at column {exc.colno})")
            except RecursionError:  # Python's parser stops at about 1,000 levels
                row = _Bad("JSON nested too deeply to read")
            yield where, row


def _json_rows(path: Path, truncated_ok: bool) -> Iterator[tuple[str, Any]]:
    """A JSON array file: (file[index], row). A file that does not parse is refused whole (its
    line is named), except a packaged file that is cut short on purpose."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            "data.source", f"{path}:{line}: invalid UTF-8 (byte {exc.start})"
        ) from None
    if truncated_ok:
        for i, row in enumerate(iter_truncated_json_array(text)):
            yield f"{path}[{i}]", row
        return
    try:
        rows = json.loads(text)
    except RecursionError:
        raise ConfigError("data.source", f"{path}: JSON nested too deeply to read") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(
            "data.source",
            f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno}); a .json "
            "file must hold one array of records (use .jsonl for one record per line)",
        ) from None
    if isinstance(rows, dict):  # {"data": [...]} and the like: the one list inside
        lists = [v for v in rows.values() if isinstance(v, list)]
        rows = lists[0] if len(lists) == 1 else rows
    if not isinstance(rows, list):
        raise ConfigError("data.source", f"{path}: expected a JSON array of records")
    for i, row in enumerate(rows):
        yield f"{path}[{i}]", row


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq  # installed with datasets; only for parquet files

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow's errors say what, not which file
        raise ConfigError(
            "data.source", f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})"
        ) from None
    for i, row in enumerate(table.to_pylist()):
        yield f"{path} row {i}", row


def _file_rows(path: Path, truncated_ok: bool = False) -> Iterator[tuple[str, Any]]:
    kind = LOCAL_SUFFIXES.get(path.suffix.lower())
    if kind == "jsonl":
        return _jsonl_rows(path)
    if kind == "json":
        return _json_rows(path, truncated_ok)
    if kind == "parquet":
        return _parquet_rows(path)
    raise ConfigError("data.source", f"{path}: expected a .jsonl, .json or .parquet file")


def local_path(source: str) -> Path | None:
    """The local file `data.source` names, or None for a package or hub source. A source that
    looks like a path must exist, be a readable non-empty file of a known kind."""
    if source.startswith(PACKAGE_PREFIX):
        return None
    path = Path(source).expanduser()
    if not path.exists():
        if source.startswith(_LOCAL_PREFIXES) or path.suffix.lower() in LOCAL_SUFFIXES:
            raise ConfigError("data.source", f"local data file {source} does not exist")
        return None  # a hub dataset id
    if path.is_dir():
        raise ConfigError("data.source", f"{path} is a folder; name a .jsonl/.json/.parquet file")
    if path.suffix.lower() not in LOCAL_SUFFIXES:
        raise ConfigError("data.source", f"{path}: expected a .jsonl, .json or .parquet file")
    if not os.access(path, os.R_OK):
        raise ConfigError("data.source", f"{path} is not readable by this user")
    if path.stat().st_size == 0:
        raise ConfigError("data.source", f"{path} is empty")
    return path.resolve()


def _source_files(data_cfg: ConversationSource) -> tuple[list[Path], bool]:
    """The files a package or local source reads ([] for a hub dataset), and whether they are a
    package's (whose JSON may be cut short on purpose)."""
    source = data_cfg.source
    if source.startswith(PACKAGE_PREFIX):
        module = source[len(PACKAGE_PREFIX) :]
        pkg = package_dir(module, "data.source")
        files = sorted(pkg.rglob("*.json")) + sorted(pkg.rglob("*.jsonl"))
        if not files:
            raise ConfigError("data.source", f"package {module} holds no .json/.jsonl file")
        return files, True
    path = local_path(source)
    return ([path] if path else []), False


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


@dataclass
class Conversations:
    turns: list[list[dict[str, str]]]
    rows_read: int
    # reason -> rows dropped for it (malformed, unknown_role, no_assistant_turn)
    dropped: Counter = field(default_factory=Counter)
    # (where, reason: detail) of the first few dropped rows, for the message and the manifest
    examples: list[str] = field(default_factory=list)
    # data.multimodal=drop_media: media parts dropped, and the rows that had them
    media_dropped: int = 0
    rows_with_media: int = 0


def _hub_rows(data_cfg: ConversationSource) -> Iterator[tuple[str, Any]]:
    import datasets  # slow import: only for hub datasets

    try:
        ds = datasets.load_dataset(
            data_cfg.source, split=data_cfg.split, revision=data_cfg.revision
        )
    except Exception as exc:  # the hub is unreachable, or the split is wrong
        raise ConfigError(
            "data.source",
            f"could not load hub dataset {data_cfg.source!r} split {data_cfg.split!r}: {exc}",
        ) from exc
    for i, row in enumerate(ds):
        yield f"{data_cfg.source}[{data_cfg.split}] row {i}", row


def read_conversations(data_cfg: ConversationSource) -> Conversations:
    files, packaged = _source_files(data_cfg)
    if files:
        rows: Iterator[tuple[str, Any]] = (
            r for f in files for r in _file_rows(f, truncated_ok=packaged)
        )
    else:
        rows = _hub_rows(data_cfg)
    fields = [data_cfg.column] if data_cfg.column else list(CONVERSATION_FIELDS)
    out = Conversations(turns=[], rows_read=0)
    saw_field = False
    first_bad: str | None = None
    first_media: str | None = None
    drop_media = data_cfg.multimodal == "drop_media"
    records = 0  # rows that are JSON records at all
    for where, row in rows:
        out.rows_read += 1
        if isinstance(row, _Bad):
            reason, detail = MALFORMED, str(row)
        elif not isinstance(row, dict):
            reason, detail = MALFORMED, f"a {type(row).__name__}, not a record"
        else:
            records += 1
            name = next((f for f in fields if f in row), None)
            if name is None:
                reason, detail = MALFORMED, f"no {' / '.join(fields)} field"
            else:
                saw_field = True
                turns, reason, detail, media = classify_turns(row[name], drop_media)
                if turns is not None:
                    out.turns.append(turns)
                    out.media_dropped += media
                    out.rows_with_media += bool(media)
                    continue
        if reason == MALFORMED and first_bad is None:
            first_bad = f"{where}: {detail}"
        if reason == MULTIMODAL and first_media is None:
            first_media = f"{where}: {detail}"
        out.dropped[reason] += 1
        if len(out.examples) < 5:
            out.examples.append(f"{where}: {reason}: {detail}")
    source = data_cfg.source
    if out.rows_read == 0:
        raise ConfigError("data.source", f"{source} holds no row")
    if records == 0 and first_bad is not None:
        raise ConfigError(
            "data.source",
            f"no row of {source} is readable: {out.rows_read} malformed, the first at {first_bad}",
        )
    if not saw_field:
        raise ConfigError(
            "data.column",
            f"no row of {source} has a column named {' / '.join(fields)}; set data.column to the "
            "column holding the list of turns",
        )
    # Decided after the whole file is read, so that the message can say how many there are.
    if first_bad is not None and data_cfg.on_bad_row == "fail":
        raise ConfigError(
            "data.source",
            f"{out.dropped[MALFORMED]} malformed row(s) of {out.rows_read}, the first at "
            f"{first_bad}. Fix or remove them, or set data.on_bad_row=skip to drop them "
            "(they are counted)",
        )
    if first_media is not None:
        raise ConfigError(
            "data.multimodal",
            f"{out.dropped[MULTIMODAL]} row(s) of {source} have image or other media parts, the "
            f"first at {first_media}. Drafts train on text here: set data.multimodal=drop_media "
            "to keep their text parts (the dropped parts are counted), or remove those rows",
        )
    if not out.turns:
        raise ConfigError(
            "data.source",
            f"{source} holds no usable conversation: {out.rows_read} rows read, dropped "
            f"{dict(out.dropped)}; first: {out.examples[0] if out.examples else '-'}",
        )
    if data_cfg.shuffle:
        random.Random(data_cfg.seed).shuffle(out.turns)
    return out


def load_conversations(data_cfg: ConversationSource) -> list[list[dict[str, str]]]:
    """Just the usable conversations (see `read_conversations`)."""
    return read_conversations(data_cfg).turns


def hub_problem(data_cfg: ConversationSource, timeout_s: float = 10.0) -> str | None:
    """Why a hub dataset cannot be read from here, or None: the hub must answer for it (within
    `timeout_s`), or the local Hugging Face cache must hold it (offline machines)."""
    from huggingface_hub import HfApi, constants  # light; only for hub sources

    repo = data_cfg.source
    cached = Path(constants.HF_HUB_CACHE) / f"datasets--{repo.replace('/', '--')}"
    if cached.is_dir():
        return None
    if constants.HF_HUB_OFFLINE:
        return f"not in the local Hugging Face cache ({cached}) and HF_HUB_OFFLINE is set"
    try:
        HfApi().dataset_info(repo, revision=data_cfg.revision, timeout=timeout_s)
    except Exception as exc:  # unreachable hub, unknown repo or revision, gated
        return (
            f"the hub does not answer for it ({type(exc).__name__}: {str(exc)[:160]}) and the "
            f"local Hugging Face cache has no copy ({cached})"
        )
    return None


# ---------------------------------------------------------------------------------------------
# Fingerprints and the plan-time inspection, cached per file content
# ---------------------------------------------------------------------------------------------

_MEMO: dict[tuple[str, int, int], dict[str, Any]] = {}


def _cache_file(cache_dir: Path) -> Path:
    return cache_dir / "data_files.json"


def _load_cache(cache_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads(_cache_file(cache_dir).read_text())
        return data if data.get("version") == _CACHE_VERSION else {"version": _CACHE_VERSION}
    except (OSError, ValueError):
        return {"version": _CACHE_VERSION}


def _save_cache(cache_dir: Path, data: dict[str, Any]) -> None:
    """Atomic replace; two plans writing at once lose at most an entry, recomputed later."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = _cache_file(cache_dir).with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, _cache_file(cache_dir))
    except OSError:
        pass  # a cache only: an unwritable one costs time, not correctness


def _stamp(st: os.stat_result) -> dict[str, int]:
    """What tells a file unchanged without reading it: size and mtime can be kept by an edit
    (`cp -p`, `rsync -t`, `tar x`, `touch -r`), but each of those gives the file a new inode
    or a new ctime, which no user tool can set back."""
    return {
        "bytes": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
    }


def _file_entry(path: Path, cache: dict[str, Any]) -> dict[str, Any]:
    """{sha256, bytes, ...} of `path`, hashed again whenever its stamp (size, mtime, ctime,
    inode) changed."""
    stamp = _stamp(path.stat())
    memo_key = (str(path), *stamp.values())
    files = cache.setdefault("files", {})
    entry = files.get(str(path))
    if entry and all(entry.get(k) == v for k, v in stamp.items()):
        _MEMO[memo_key] = entry
        return entry
    if memo_key in _MEMO:
        files[str(path)] = _MEMO[memo_key]
        return _MEMO[memo_key]
    with open(path, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    entry = {"sha256": digest, **stamp}
    files[str(path)] = _MEMO[memo_key] = entry
    return entry


def data_fingerprint(data_cfg: ConversationSource, cache_dir: Path) -> dict[str, Any]:
    """What the prepare key holds about the data's content (see the module docstring)."""
    files, _ = _source_files(data_cfg)
    if not files:
        return {"hub_revision": data_cfg.revision or "unpinned"}
    cache = _load_cache(cache_dir)
    before = json.dumps(cache, sort_keys=True)
    out = {}
    for f in files:
        e = _file_entry(f, cache)
        out[f.name] = {"sha256": e["sha256"], "bytes": e["bytes"]}
    if json.dumps(cache, sort_keys=True) != before:
        _save_cache(cache_dir, cache)
    return out


def inspect_local(data_cfg: ConversationSource, cache_dir: Path) -> dict[str, Any] | None:
    """For a local file: {rows, usable, dropped, examples, sha256}, read as prepare reads it
    (raising the same ConfigError for a malformed row or an unusable file); None for a package
    or hub source. Remembered per content, column, data.on_bad_row and data.multimodal."""
    path = local_path(data_cfg.source)
    if path is None:
        return None
    cache = _load_cache(cache_dir)
    entry = _file_entry(path, cache)
    key = f"{entry['sha256']}|{data_cfg.column}|{data_cfg.on_bad_row}|{data_cfg.multimodal}|2"
    seen = cache.setdefault("inspections", {})
    if key not in seen:
        conv = read_conversations(replace(data_cfg, source=str(path), shuffle=False))
        seen[key] = {
            "rows": conv.rows_read,
            "usable": len(conv.turns),
            # Conversations with a system turn: the plan checks the chat template renders one.
            "system_rows": sum(any(t["role"] == "system" for t in c) for c in conv.turns),
            "dropped": dict(conv.dropped),
            "examples": conv.examples,
            "media_parts_dropped": conv.media_dropped,
        }
    _save_cache(cache_dir, cache)
    return {**seen[key], "sha256": entry["sha256"]}


def usable_count(data_cfg: ConversationSource, cache_dir: Path) -> int | None:
    """How many usable conversations a packaged or local source holds (None for a hub dataset,
    whose size only prepare learns): read once and remembered per content, so that a plan can
    say in seconds what data.num_samples leaves unread."""
    if local_path(data_cfg.source) is not None:
        seen = inspect_local(data_cfg, cache_dir)
        return None if seen is None else int(seen["usable"])
    files, _ = _source_files(data_cfg)
    if not files:
        return None
    content = data_fingerprint(data_cfg, cache_dir)
    key = json.dumps([content, data_cfg.column, data_cfg.on_bad_row, data_cfg.multimodal])
    cache = _load_cache(cache_dir)
    counts = cache.setdefault("usable_counts", {})
    if key not in counts:
        counts[key] = len(read_conversations(data_cfg).turns)
        _save_cache(cache_dir, cache)
    return int(counts[key])
