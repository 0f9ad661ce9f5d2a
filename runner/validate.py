"""Checks of the composed config that need facts about the target, and the facts themselves.

`check_declared(cfg)` runs right after composition, before anything is loaded, on the facts the
model yaml declares. `resolve_facts(cfg, output_root)` then reads the target's configuration
files only (config.json, tokenizer_config.json, a packaged GGUF's metadata; no weights), checks
the declared facts, remote-code needs and capture layers against them, and returns `ModelFacts`
(the numbers every stage uses) with the target's `TargetLayout` (runner/adapters.py).

Layer ids use the vLLM / speculators convention (see runner/schema.py); `capture_ids` is the
auxiliary ids plus the final pre-norm id n, distinct and ascending as vLLM requires.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runner.errors import ConfigError
from runner.schema import STAGES

KNOWN_DTYPES = ("bfloat16", "float16", "float32")
LAYOUT_VERSION = "1"  # bump when runner.adapters changes what a layout holds


@dataclass(frozen=True)
class ModelFacts:
    path: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    aux_layers: tuple[int, ...]
    # What extraction captures: the auxiliary layers of every job that shares it (a sweep's
    # union; in a single run the same as aux_layers). The final layer n is added to both.
    extract_aux: tuple[int, ...]
    # Fingerprints that key cached artifacts: one for the tokenizer, one for the weights.
    tokenizer_id: str
    weights_id: str

    @property
    def capture_ids(self) -> tuple[int, ...]:
        return (*self.aux_layers, self.num_layers)

    @property
    def extract_ids(self) -> tuple[int, ...]:
        return (*self.extract_aux, self.num_layers)

    @property
    def train_slots(self) -> tuple[int, ...]:
        """Positions of this job's capture ids among the extracted slots."""
        return tuple(self.extract_ids.index(i) for i in self.capture_ids)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["capture_ids"] = list(self.capture_ids)
        d["extract_ids"] = list(self.extract_ids)
        return d


def default_aux_layers(n: int) -> list[int]:
    """speculators' and vLLM's default EAGLE-3 aux layers: [2, n//2, n-3]."""
    return [2, n // 2, n - 3]


CAPTURE_PRESETS = {
    "default": default_aux_layers,
    "early": lambda n: [1, n // 4, n // 2],
    "late": lambda n: [n // 2, (3 * n) // 4, n - 2],
    "four": lambda n: [2, n // 3, (2 * n) // 3, n - 3],
}


def preset_layers(name: str, n: int, key: str = "model.capture_preset") -> list[int]:
    if name not in CAPTURE_PRESETS:
        raise ConfigError(key, f"unknown preset {name!r}; choose from {sorted(CAPTURE_PRESETS)}")
    return CAPTURE_PRESETS[name](n)


def aux_and_superset(cfg: Any, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This job's auxiliary layers and what extraction captures (with the sweep's other choices)."""
    aux = cfg.model.capture_layers
    mine = check_aux_layers(list(aux) if aux is not None else preset_layers(cfg.model.capture_preset, n), n)
    union = set(mine)
    for name in cfg.extract.superset_presets:
        union.update(check_aux_layers(preset_layers(name, n, "extract.superset_presets"), n))
    return mine, tuple(sorted(union))


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
            if key == "_target_":
                raise ConfigError(full, "the runner instantiates no classes from config; remove it")
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
    x = cfg.extract
    if x.backend not in ("transformers", "vllm"):
        raise ConfigError("extract.backend", f"'{x.backend}' is not transformers or vllm")
    for name in ("concurrency", "request_timeout_s"):
        if x[name] < 1:
            raise ConfigError(f"extract.{name}", "must be >= 1")
    if x.max_retries < 0:
        raise ConfigError("extract.max_retries", "must be >= 0")
    if hw.vllm.ready_timeout_s < 1:
        raise ConfigError("hardware.vllm.ready_timeout_s", "must be >= 1")
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
    if m.num_layers is not None:
        aux_and_superset(cfg, m.num_layers)


def _sha(*parts: Any) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else str(part).encode())
    return h.hexdigest()[:16]


def _folder_fingerprint(folder: Path, names: tuple[str, ...]) -> str:
    return _sha(*[name.encode() + (folder / name).read_bytes() for name in names if (folder / name).is_file()])


def read_target_config(model_cfg: Any, output_root: Path) -> tuple[dict[str, Any], str, str, str]:
    """(config.json contents, path the weights will load from, tokenizer id, weights id).

    Reads configuration only: a local config.json, a packaged GGUF's metadata, or a hub
    config.json (from the local HF cache when offline). No weights load, nothing is converted.
    """
    from runner.assets import PACKAGE_PREFIX, _package_dir, packaged_model_dir

    source: str = model_cfg.source
    template = model_cfg.chat_template or ""
    if source.startswith(PACKAGE_PREFIX):
        module = source[len(PACKAGE_PREFIX):]
        if not model_cfg.gguf_file:
            raise ConfigError("model.gguf_file", "a package: model source needs model.gguf_file")
        gguf = _package_dir(module, "model.source") / model_cfg.gguf_file
        if not gguf.is_file():
            raise ConfigError("model.gguf_file", f"{gguf} not found in package {module}")
        dest = packaged_model_dir(model_cfg, output_root)
        if (dest / "config.json").is_file():
            config = json.loads((dest / "config.json").read_text())
        else:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).to_dict()
        ident = _sha(module, gguf.name, gguf.stat().st_size)
        return config, str(dest), _sha(ident, template), ident
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError("model.source", f"{path} has no config.json")
        config = json.loads((path / "config.json").read_text())
        tok = _folder_fingerprint(path, ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                         "tokenizer.model", "tiktoken.model", "special_tokens_map.json"))
        weights = _sha((path / "config.json").read_bytes(),
                       *[f"{f.name}:{f.stat().st_size}" for f in sorted(path.glob("*.safetensors"))])
        return config, str(path.resolve()), _sha(tok, template), weights
    if source.startswith(("/", "./", "../", "~")):
        raise ConfigError("model.source", f"local model folder {source} does not exist")
    try:
        from huggingface_hub import hf_hub_download

        cfg_file = hf_hub_download(source, "config.json", revision=model_cfg.revision)
    except Exception as exc:
        raise ConfigError("model.source", f"cannot read config.json of hub model {source!r} ({type(exc).__name__}); "
                                          "download the model or point model.source at a local folder") from None
    config = json.loads(Path(cfg_file).read_text())
    ident = _sha(source, model_cfg.revision)
    return config, source, _sha(ident, template), ident


def remote_code_reasons(config: dict[str, Any], model_path: str) -> list[str]:
    """Why loading this target would execute code from its repository (empty: it would not)."""
    from transformers import CONFIG_MAPPING

    reasons = []
    if config.get("auto_map") and config.get("model_type") not in CONFIG_MAPPING:
        reasons.append(f"config.json maps model_type {config.get('model_type')!r}, unknown to transformers, to custom classes")
    tok_cfg = Path(model_path) / "tokenizer_config.json"
    if tok_cfg.is_file():
        auto = json.loads(tok_cfg.read_text()).get("auto_map") or {}
        if "AutoTokenizer" in auto:
            reasons.append(f"tokenizer_config.json maps AutoTokenizer to {auto['AutoTokenizer'][0]}")
    return reasons


def cached_layout(config: dict[str, Any], override: dict[str, str], output_root: Path) -> Any:
    """`layout_from_config`, remembered per config.json content: building even a meta model needs
    transformers' modeling code (~2 s to import), which a repeated plan should not pay again."""
    from runner.adapters import TargetLayout, layout_from_config

    key = _sha(json.dumps(config, sort_keys=True), json.dumps(override, sort_keys=True), LAYOUT_VERSION)
    path = output_root / "cache" / "layouts" / f"{key}.json"
    if path.is_file():
        return TargetLayout(**json.loads(path.read_text()))
    try:
        layout = layout_from_config(config, override)
    except ValueError as exc:
        raise ConfigError("model.layout", str(exc)) from None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(layout.as_dict()))
    os.replace(tmp, path)
    return layout


def resolve_facts(cfg: Any, output_root: Path) -> tuple[ModelFacts, Any, dict[str, Any]]:
    """Facts, layout and raw config of the target, from configuration files only."""
    config, path, tok_id, weights_id = read_target_config(cfg.model, output_root)
    reasons = remote_code_reasons(config, path)
    if reasons and not cfg.model.trust_remote_code:
        raise ConfigError("model.trust_remote_code", f"{'; '.join(reasons)}. Set model.trust_remote_code=true if "
                                                     f"you trust {cfg.model.source}")
    if cfg.model.trust_remote_code and not reasons:
        raise ConfigError("model.trust_remote_code",
                          f"is true but {cfg.model.source} needs no custom code (transformers ships its classes and "
                          "its tokenizer); set it false so that no downloaded code runs")
    arch = (config.get("architectures") or [None])[0]
    if cfg.model.architecture and arch and cfg.model.architecture != arch:
        raise ConfigError("model.architecture", f"expects {cfg.model.architecture} but config.json says {arch}")
    layout = cached_layout(config, dict(cfg.model.layout), output_root)
    actual = {"num_layers": layout.num_layers, "hidden_size": layout.hidden_size, "vocab_size": layout.vocab_size}
    for name, value in actual.items():
        declared = cfg.model.get(name)
        if declared is not None and declared != value:
            raise ConfigError(f"model.{name}", f"declares {declared} but the target's config.json says {value}")
    n = layout.num_layers
    aux_layers, extract_aux = aux_and_superset(cfg, n)
    if cfg.train.draft_vocab_size > layout.vocab_size:
        raise ConfigError("train.draft_vocab_size",
                          f"{cfg.train.draft_vocab_size} is larger than the target's vocab ({layout.vocab_size})")
    facts = ModelFacts(path=path, num_layers=n, hidden_size=layout.hidden_size, vocab_size=layout.vocab_size,
                       aux_layers=aux_layers, extract_aux=extract_aux, tokenizer_id=tok_id, weights_id=weights_id)
    return facts, layout, config
