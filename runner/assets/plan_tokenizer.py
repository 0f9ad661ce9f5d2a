"""The target's tokenizer as the plan reads it, before any weights load: once per process, shared
by the stages' plan checks (prepare renders one chat turn with it; evaluate measures its longest
prompt).

    found = plan_tokenizer(cfg, target)   # (tokenizer, where it came from), or None
    n = remembered(cfg, target, "what", parts, lambda: measure(found))   # cached measurements

None when there is nothing to load here: a config-only copy of a custom-code tokenizer. A
packaged GGUF's tokenizer is read from the GGUF before its conversion (seconds, then kept as a
plain folder under the root's cache). A tokenizer that does not load, or a folder without
tokenizer files, is refused naming the key.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from runner.assets.target_facts import Target, model_source
from runner.core.errors import ConfigError
from runner.core.json_cache import remembered as remembered_json
from runner.core.layout import RunLayout
from runner.core.schema import RunnerConfig


def _tokenizer_file(name: str) -> bool:
    return name.startswith(("tokenizer", "vocab.", "merges.txt")) or name.endswith(
        (".model", ".tiktoken")
    )


@functools.lru_cache(maxsize=4)
def _load(path: str, trust_remote_code: bool, gguf_file: str | None, kept: str | None) -> Any:
    from transformers import AutoTokenizer  # slow import; the plan has it loaded already

    if gguf_file is None:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    assert kept is not None
    folder = Path(kept)
    if (folder / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(kept)
    tok = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    if folder.exists():  # another plan kept it first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(folder)
    return tok


def plan_tokenizer(cfg: RunnerConfig, target: Target) -> tuple[Any, Path] | None:
    path = Path(target.facts.path)
    if path.is_dir():
        names = {f.name for f in path.iterdir()}
        if not any(_tokenizer_file(n) for n in names):
            raise ConfigError(
                "model.source",
                f"{path} has no tokenizer files (tokenizer.json, tokenizer_config.json, ...): "
                "prepare could not tokenize the data",
            )
        custom = any("AutoTokenizer" in r for r in target.remote_code_reasons)
        if custom and not any(n.startswith("tokenization_") and n.endswith(".py") for n in names):
            return None  # its code is not in the folder (a config-only copy)
        key, args = "model.source", (str(path), cfg.model.trust_remote_code, None, None)
        where = path
    else:
        root = Path(cfg.run.output_root).expanduser()
        src = model_source(cfg.model, root)
        if src.kind != "package" or src.gguf is None:
            return None
        name = f"{src.gguf.name}-{src.gguf.stat().st_size}"
        kept = RunLayout(root).cache / "gguf_tokenizers" / name
        kept.parent.mkdir(parents=True, exist_ok=True)
        key, args = "model.gguf_file", (str(src.gguf.parent), False, src.gguf.name, str(kept))
        where = src.gguf
    try:
        tok = _load(*args)
    except Exception as exc:  # transformers raises many kinds for a broken tokenizer
        raise ConfigError(
            key, f"the tokenizer at {where} does not load ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    if cfg.model.chat_template:
        tok = _with_template(tok, cfg.model.chat_template)
    return tok, where


def _with_template(tok: Any, template: str) -> Any:
    """A copy with `model.chat_template` (the cached tokenizer keeps its own)."""
    import copy

    out = copy.copy(tok)
    out.chat_template = template
    return out


def remembered(cfg: RunnerConfig, target: Target, what: str, parts: Any, measure: Any) -> Any:
    """`measure()` (which loads the tokenizer: seconds, mostly importing transformers), kept in
    the root's cache per tokenizer, template and `parts`, so that a warm plan compares the
    settings with numbers it already has. Only measurements are kept, never a verdict: a
    refusal (a ConfigError from `measure`) is found again each time."""
    layout = RunLayout(Path(cfg.run.output_root).expanduser())
    file = layout.cache / "tokenizer_measures.json"
    ident = [target.facts.tokenizer_id, target.facts.path, cfg.model.chat_template, what, parts]
    key = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()
    return remembered_json(file, key, lambda: (measure(), True))


def file_stamp(name: str) -> Any:
    """What tells a prompt file unchanged (path, size, mtime, ctime); a packaged set's name."""
    path = Path(name).expanduser()
    if not path.is_file():
        return name
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns]
