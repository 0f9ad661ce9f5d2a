"""Checks of the composed config that need facts about the target, and the facts themselves.

`check_declared(cfg)` runs right after composition, before anything is loaded, on the facts the
model yaml declares. `resolve_facts(cfg, model_path)` then reads the target's config.json (no
weights), checks the declared facts against it and returns `ModelFacts`: the numbers every stage
uses (layer count, hidden size, vocab size, capture ids).

Layer ids use the vLLM / speculators convention (see runner/schema.py); `capture_ids` is the
auxiliary ids plus the final pre-norm id n, distinct and ascending as vLLM requires.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runner.errors import ConfigError
from runner.schema import STAGES

KNOWN_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class ModelFacts:
    path: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    aux_layers: tuple[int, ...]
    # Fingerprints that key cached artifacts: one for the tokenizer, one for the weights.
    tokenizer_id: str
    weights_id: str

    @property
    def capture_ids(self) -> tuple[int, ...]:
        return (*self.aux_layers, self.num_layers)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["capture_ids"] = list(self.capture_ids)
        return d


def default_aux_layers(n: int) -> list[int]:
    """speculators' and vLLM's default EAGLE-3 aux layers: [2, n//2, n-3]."""
    return [2, n // 2, n - 3]


def check_aux_layers(layers: list[int], n: int) -> tuple[int, ...]:
    key = "model.capture_layers"
    if not layers:
        raise ConfigError(key, "needs at least one auxiliary layer id")
    if len(set(layers)) != len(layers):
        raise ConfigError(key, f"{layers} has duplicates; vLLM de-duplicates ids and the draft's "
                               "input width would no longer match")
    for lid in layers:
        if not 0 <= lid < n:
            hint = " (the final layer n is appended automatically; list auxiliary layers only)" if lid == n else ""
            raise ConfigError(key, f"layer id {lid} is outside 0..{n - 1} for a {n}-layer target{hint}")
    if list(layers) != sorted(layers):
        raise ConfigError(key, f"{layers} must be ascending (vLLM sorts them; the draft would see "
                               "its inputs in another order)")
    return tuple(int(x) for x in layers)


def check_known_keys(cfg: Any) -> None:
    """Reject keys the schema does not know, including ones added with Hydra's `+key=value`
    (which bypasses the schema's struct mode). Free-form dicts (env, extra args) are exempt."""
    from omegaconf import DictConfig, OmegaConf

    from runner.schema import RunnerConfig

    def walk(node: Any, schema: Any, prefix: str) -> None:
        for key in node.keys():
            if key == "hydra":
                continue
            full = f"{prefix}{key}"
            if key not in list(schema.keys()):
                known = ", ".join(sorted(str(k) for k in schema.keys()))
                raise ConfigError(full, f"unknown key; {prefix.rstrip('.') or 'the root'} takes: {known}")
            sub = schema.get(key) if OmegaConf.is_dict(schema) else None
            if isinstance(sub, DictConfig) and len(sub) and OmegaConf.get_type(sub) is not dict:
                walk(node[key], sub, full + ".")

    walk(cfg, OmegaConf.structured(RunnerConfig), "")


def check_declared(cfg: Any) -> None:
    """Every check that needs nothing but the composed config."""
    check_known_keys(cfg)
    unknown = [s for s in cfg.run.stages if s not in STAGES]
    if unknown:
        raise ConfigError("run.stages", f"unknown stage(s) {unknown}; choose from {list(STAGES)}")
    bad_force = [s for s in cfg.run.force if s not in STAGES and s != "all"]
    if bad_force:
        raise ConfigError("run.force", f"unknown stage(s) {bad_force}; choose from {list(STAGES)} or all")
    hw = cfg.hardware
    if hw.device not in ("cpu", "cuda"):
        raise ConfigError("hardware.device", f"'{hw.device}' is not cpu or cuda")
    if hw.dtype not in KNOWN_DTYPES:
        raise ConfigError("hardware.dtype", f"'{hw.dtype}' is not one of {KNOWN_DTYPES}")
    if hw.tensor_parallel_size < 1:
        raise ConfigError("hardware.tensor_parallel_size", "must be >= 1")
    if hw.device == "cuda" and hw.tensor_parallel_size > max(hw.num_gpus, 1):
        raise ConfigError("hardware.tensor_parallel_size",
                          f"{hw.tensor_parallel_size} exceeds hardware.num_gpus={hw.num_gpus}")
    if hw.extract_batch_size < 1:
        raise ConfigError("hardware.extract_batch_size", "must be >= 1")
    d = cfg.data
    if d.num_samples < 1:
        raise ConfigError("data.num_samples", "must be >= 1")
    if d.max_seq_len < 16:
        raise ConfigError("data.max_seq_len", f"{d.max_seq_len} is too short for a chat turn")
    t = cfg.train
    if t.draft_vocab_size < 1:
        raise ConfigError("train.draft_vocab_size", "must be >= 1")
    if t.num_layers < 1:
        raise ConfigError("train.num_layers", "must be >= 1")
    if t.ttt_steps < 1:
        raise ConfigError("train.ttt_steps", "must be >= 1")
    if not 0 < t.val_ratio < 1:
        raise ConfigError("train.val_ratio", f"{t.val_ratio} must be in (0, 1)")
    if t.total_seq_len is not None and t.total_seq_len < d.max_seq_len:
        raise ConfigError("train.total_seq_len",
                          f"{t.total_seq_len} is below data.max_seq_len={d.max_seq_len}; a sample would not fit a batch")
    if t.loss_implementation == "fused" and hw.device == "cpu":
        raise ConfigError("train.loss_implementation", "'fused' is a Triton GPU kernel; use 'eager' on CPU")
    if t.draft_attn_impl == "simple_flex_attention" and hw.device == "cpu":
        raise ConfigError("train.draft_attn_impl", "flex attention needs a GPU; use 'sdpa' on CPU")
    e = cfg.eval
    if e.num_speculative_tokens < 1:
        raise ConfigError("eval.num_speculative_tokens", "must be >= 1")
    if e.num_prompts < 1:
        raise ConfigError("eval.num_prompts", "must be >= 1")
    m = cfg.model
    if m.vocab_size is not None and t.draft_vocab_size > m.vocab_size:
        raise ConfigError("train.draft_vocab_size",
                          f"{t.draft_vocab_size} is larger than the target's vocab ({m.vocab_size})")
    if m.num_layers is not None and m.capture_layers is not None:
        check_aux_layers(list(m.capture_layers), m.num_layers)


def _text_config(hf_config: Any) -> Any:
    # Multimodal wrappers keep the language model's numbers in text_config.
    return getattr(hf_config, "text_config", None) or hf_config


def _fingerprint(model_path: str, names: tuple[str, ...]) -> str:
    p = Path(model_path)
    h = hashlib.sha256()
    if not p.is_dir():  # a hub id: identity is the id itself
        h.update(model_path.encode())
        return h.hexdigest()[:16]
    for name in names:
        f = p / name
        if f.is_file():
            h.update(name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _weights_fingerprint(model_path: str) -> str:
    p = Path(model_path)
    if not p.is_dir():
        return hashlib.sha256(model_path.encode()).hexdigest()[:16]
    h = hashlib.sha256((p / "config.json").read_bytes())
    # Names and sizes of the weight files: hashing hundreds of GB of shards is not an option.
    for f in sorted(p.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def resolve_facts(cfg: Any, model_path: str) -> ModelFacts:
    from runner.assets import read_model_config

    hf = _text_config(read_model_config(model_path, cfg.model.trust_remote_code))
    actual = {"num_layers": hf.num_hidden_layers, "hidden_size": hf.hidden_size, "vocab_size": hf.vocab_size}
    for name, value in actual.items():
        declared = cfg.model.get(name)
        if declared is not None and declared != value:
            raise ConfigError(f"model.{name}", f"declares {declared} but {model_path}/config.json says {value}")
    n = actual["num_layers"]
    aux = cfg.model.capture_layers
    aux_layers = check_aux_layers(list(aux) if aux is not None else default_aux_layers(n), n)
    if cfg.train.draft_vocab_size > actual["vocab_size"]:
        raise ConfigError("train.draft_vocab_size",
                          f"{cfg.train.draft_vocab_size} is larger than the target's vocab ({actual['vocab_size']})")
    tok_id = _fingerprint(model_path, ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                       "tokenizer.model", "special_tokens_map.json"))
    if cfg.model.chat_template:
        tok_id = hashlib.sha256((tok_id + cfg.model.chat_template).encode()).hexdigest()[:16]
    return ModelFacts(
        path=model_path, num_layers=n, hidden_size=actual["hidden_size"], vocab_size=actual["vocab_size"],
        aux_layers=aux_layers, tokenizer_id=tok_id, weights_id=_weights_fingerprint(model_path),
    )


def facts_summary(facts: ModelFacts) -> str:
    return json.dumps(facts.as_dict(), indent=None)
