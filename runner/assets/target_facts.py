"""The target's facts, read from its configuration files only (no weights, no remote code).

`resolve_target(cfg, output_root)` returns a `Target`: the numbers every stage uses
(`ModelFacts`), where the text model lives (`TargetLayout`, runner/assets/target_layout.py) and the
raw
config.json. `model_source(cfg.model, output_root)` is the one place that tells a packaged GGUF,
a local folder and a hub id apart; preflight reads configuration through it and
`runner.assets.sources.resolve_model` materialises weights through it.

Checks of the config against these facts live in runner/engine/checks.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runner.assets.target_layout import TargetLayout, layout_from_config
from runner.core.errors import ConfigError
from runner.core.json_cache import remembered as remembered_answer
from runner.core.layer_ids import CAPTURE_PRESETS
from runner.core.layout import RunLayout, user_cache
from runner.core.packages import PACKAGE_PREFIX, package_dir
from runner.core.schema import ModelConfig, RunnerConfig

log = logging.getLogger("runner")

MINIATURE_PREFIX = "miniature:"
LAYOUT_VERSION = "1"  # bump when runner.assets.target_layout changes what a layout holds
_LOCAL_PREFIXES = ("/", "./", "../", "~")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "tokenizer.model",
    "tiktoken.model",
    "special_tokens_map.json",
)


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


@dataclass(frozen=True)
class Target:
    facts: ModelFacts
    layout: TargetLayout
    # config.json as read (the text model's fields may sit under text_config).
    config: dict[str, Any]
    # Why loading it runs code from its repository (empty: it does not).
    remote_code_reasons: tuple[str, ...]


@dataclass(frozen=True)
class ModelSource:
    """Where the target comes from, resolved once."""

    kind: str  # "package" (a GGUF inside a Python package), "local" (a folder) or "hub"
    # What from_pretrained and vLLM load: a folder (for a package, the converted one) or a hub id.
    load_path: str
    # For "package": the GGUF file.
    gguf: Path | None = None


def packaged_model_dir(model_cfg: ModelConfig, output_root: Path) -> Path:
    return RunLayout(output_root).models / model_cfg.name


def model_source(model_cfg: ModelConfig, output_root: Path) -> ModelSource:
    source = model_cfg.source
    if source.startswith(MINIATURE_PREFIX):
        # Built locally in seconds (runner/assets/miniatures.py), then an ordinary local folder.
        from runner.assets.miniatures import ensure

        return ModelSource("local", str(ensure(source[len(MINIATURE_PREFIX) :], output_root)))
    if source.startswith(PACKAGE_PREFIX):
        module = source[len(PACKAGE_PREFIX) :]
        if not model_cfg.gguf_file:
            raise ConfigError("model.gguf_file", "a package: model source needs model.gguf_file")
        gguf = package_dir(module, "model.source") / model_cfg.gguf_file
        if not gguf.is_file():
            raise ConfigError("model.gguf_file", f"{gguf} not found in package {module}")
        return ModelSource("package", str(packaged_model_dir(model_cfg, output_root)), gguf)
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError("model.source", f"{path} has no config.json")
        return ModelSource("local", str(path.resolve()))
    if source.startswith(_LOCAL_PREFIXES) or path.exists():
        raise ConfigError("model.source", f"local model folder {source} does not exist")
    return ModelSource("hub", source)


def read_json_object(path: Path, key: str) -> dict[str, Any]:
    """A JSON file that must hold one object (a config.json): any other content is refused
    naming the file and the key that points at it, instead of a traceback."""
    try:
        value = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise ConfigError(key, f"{path} is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(
            key, f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
    except RecursionError:
        raise ConfigError(key, f"{path} nests too deeply to read") from None
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror or exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(
            key, f"{path} holds a JSON {type(value).__name__}, not an object of settings"
        )
    return value


GGUF_MAGIC = b"GGUF"


def check_gguf(path: Path, key: str) -> None:
    """A GGUF file starts with the magic bytes `GGUF` (then its version): anything else would
    fail deep inside the GGUF reader."""
    with open(path, "rb") as fh:
        head = fh.read(8)
    if head[:4] != GGUF_MAGIC:
        raise ConfigError(key, f"{path} is not a GGUF file (it does not start with 'GGUF')")


def content_digest(path: Path) -> str:
    """The sha256 of a weights file's bytes: read once, then remembered in the user's cache by
    the file's real path, size, modification time and inode (an edit or a replacement gives a
    new entry). A file of the Hugging Face cache is named by its sha256 already (its blob):
    read from the name, free."""
    real = path.resolve()
    if real.parent.name == "blobs" and re.fullmatch(r"[0-9a-f]{64}", real.name):
        return real.name
    st = real.stat()

    def digest() -> tuple[str, bool]:
        if st.st_size > 1 << 30:  # minutes on a large target's shards: say why it waits
            log.info(
                "hashing %s (%.1f GiB) once: a target's identity is its weights",
                real,
                st.st_size / (1 << 30),
            )
        with open(real, "rb") as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest(), True

    key = f"{real}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
    return remembered_answer(user_cache() / "file_digests.json", key, digest)


def _sha(*parts: Any) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else str(part).encode())
    return h.hexdigest()[:16]


def read_target_config(
    model_cfg: ModelConfig, src: ModelSource, cache_dir: Path | None = None
) -> tuple[dict[str, Any], str, str]:
    """(config.json contents, tokenizer id, weights id), from configuration only: a local
    config.json, a packaged GGUF's metadata (read once, then remembered under `cache_dir`: the
    GGUF reader takes seconds), or a hub config.json (from the local HF cache when offline). No
    weights load, nothing is converted."""
    template = model_cfg.chat_template or ""
    if src.kind == "package":
        assert src.gguf is not None
        package = model_cfg.source[len(PACKAGE_PREFIX) :]
        ident = _sha(package, src.gguf.name, content_digest(src.gguf))
        converted = Path(src.load_path) / "config.json"
        remembered = cache_dir / "gguf_configs" / f"{ident}.json" if cache_dir else None
        if converted.is_file():
            config = read_json_object(converted, "model.name")
        elif remembered is not None and remembered.is_file():
            config = read_json_object(remembered, "model.gguf_file")
        else:
            from transformers import AutoConfig  # slow import, needed only before conversion

            check_gguf(src.gguf, "model.gguf_file")
            try:
                config = AutoConfig.from_pretrained(
                    src.gguf.parent, gguf_file=src.gguf.name
                ).to_dict()
            except Exception as exc:  # the GGUF reader's errors are many and untyped
                raise ConfigError(
                    "model.gguf_file",
                    f"{src.gguf}: transformers cannot read its metadata "
                    f"({type(exc).__name__}: {str(exc)[:200]})",
                ) from None
            if remembered is not None:
                remembered.parent.mkdir(parents=True, exist_ok=True)
                tmp = remembered.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps(config, default=str))
                os.replace(tmp, remembered)
        return config, _sha(ident, template), ident
    if src.kind == "local":
        path = Path(src.load_path)
        config = read_json_object(path / "config.json", "model.source")
        tok = _sha(
            *[
                n.encode() + (path / n).read_bytes()
                for n in _TOKENIZER_FILES
                if (path / n).is_file()
            ]
        )
        # The weights' own bytes, not their names and sizes: a fine-tune saved over the target,
        # or another model of the same shapes, is another target and reuses none of its stages.
        weights = _sha(
            (path / "config.json").read_bytes(),
            *[f"{f.name}:{content_digest(f)}" for f in sorted(path.glob("*.safetensors"))],
        )
        return config, _sha(tok, template), weights
    try:
        from huggingface_hub import hf_hub_download  # only for hub ids

        cfg_file = hf_hub_download(src.load_path, "config.json", revision=model_cfg.revision)
    except Exception as exc:
        raise ConfigError(
            "model.source",
            f"cannot read config.json of hub model {src.load_path!r} ({type(exc).__name__}); "
            "download the model or point model.source at a local folder",
        ) from None
    config = read_json_object(Path(cfg_file), "model.source")
    ident = _sha(src.load_path, model_cfg.revision)
    return config, _sha(ident, template), ident


def remote_code_reasons(config: dict[str, Any], model_path: str) -> tuple[str, ...]:
    """Why loading this target would execute code from its repository (empty: it would not)."""
    from transformers import CONFIG_MAPPING  # slow import; the plan needs it anyway

    reasons = []
    if config.get("auto_map") and config.get("model_type") not in CONFIG_MAPPING:
        reasons.append(
            f"config.json maps model_type {config.get('model_type')!r}, unknown to "
            "transformers, to custom classes"
        )
    tok_cfg = Path(model_path) / "tokenizer_config.json"
    if tok_cfg.is_file():
        auto = read_json_object(tok_cfg, "model.source").get("auto_map") or {}
        if "AutoTokenizer" in auto:
            reasons.append(
                f"tokenizer_config.json maps AutoTokenizer to {auto['AutoTokenizer'][0]}"
            )
    return tuple(reasons)


def cached_layout(
    config: dict[str, Any], override: dict[str, str], output_root: Path
) -> TargetLayout:
    """`layout_from_config`, remembered per config.json content: building even a meta model needs
    transformers' modeling code (~2 s to import), which a repeated plan should not pay again."""
    key = _sha(
        json.dumps(config, sort_keys=True), json.dumps(override, sort_keys=True), LAYOUT_VERSION
    )
    path = RunLayout(output_root).cache / "layouts" / f"{key}.json"
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


def aux_layers(cfg: RunnerConfig, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This job's auxiliary layers and what extraction captures (with a sweep's other choices).
    Not checked here: runner.engine.checks refuses impossible ids, naming the key."""
    m = cfg.model
    mine = (
        list(m.capture_layers)
        if m.capture_layers is not None
        else CAPTURE_PRESETS[m.capture_preset](n)
    )
    union = set(mine)
    for name in cfg.extract.superset_presets:
        union.update(CAPTURE_PRESETS[name](n))
    return tuple(int(x) for x in mine), tuple(sorted(int(x) for x in union))


def resolve_target(cfg: RunnerConfig, output_root: Path) -> Target:
    """Facts, layout and raw config of the target, from configuration files only."""
    src = model_source(cfg.model, output_root)
    config, tok_id, weights_id = read_target_config(cfg.model, src, RunLayout(output_root).cache)
    layout = cached_layout(config, dict(cfg.model.layout), output_root)
    mine, union = aux_layers(cfg, layout.num_layers)
    facts = ModelFacts(
        path=src.load_path,
        num_layers=layout.num_layers,
        hidden_size=layout.hidden_size,
        vocab_size=layout.vocab_size,
        aux_layers=mine,
        extract_aux=union,
        tokenizer_id=tok_id,
        weights_id=weights_id,
    )
    return Target(facts, layout, config, remote_code_reasons(config, src.load_path))


@dataclass(frozen=True)
class WeightEstimate:
    bytes: float
    # How it was reached, for the plan line ("bf16", "routed experts int4, rest bf16", ...).
    kind: str
    # False when config.json did not say enough (a quantization the runner cannot size): the plan
    # states the assumption and the key that overrides it, and refuses nothing on it.
    certain: bool = True


def weight_bytes(
    layout: TargetLayout, config: dict[str, Any], stated_gib: float | None = None
) -> WeightEstimate:
    """Checkpoint bytes of the text model: `model.weights_gib` when stated; else bf16, except
    routed experts when the config declares an integer quantization of them (as Kimi-K2.5's
    compressed-tensors INT4, group 32). A quantization config the runner cannot size is costed
    as bf16 and marked uncertain."""
    if stated_gib is not None:
        return WeightEstimate(stated_gib * 2**30, "stated by model.weights_gib")
    text = config.get("text_config") or config
    q = config.get("quantization_config") or text.get("quantization_config") or {}
    bits, group = None, None
    for grp in (q.get("config_groups") or {}).values():
        w = grp.get("weights") or {}
        bits, group = w.get("num_bits"), w.get("group_size")
    total = layout.text_params
    if bits and layout.num_experts:
        moe_layers = layout.num_layers - int(text.get("first_k_dense_replace", 0))
        expert_params = (
            moe_layers
            * layout.num_experts
            * 3
            * layout.hidden_size
            * int(text.get("moe_intermediate_size", 0))
        )
        per_param = bits / 8 + (2 / group if group else 0)  # packed ints + a bf16 scale per group
        estimate = expert_params * per_param + (total - expert_params) * 2
        return WeightEstimate(estimate, f"routed experts int{bits}, rest bf16")
    if q:
        method = q.get("quant_method") or q.get("format") or "unknown"
        what = "/".join(str(x) for x in (q.get("quant_method"), q.get("format")) if x) or method
        return WeightEstimate(
            total * 2.0,
            f"ASSUMED bf16: quantization_config ({what}) names no sizes the runner reads; "
            "state the size with model.weights_gib",
            certain=False,
        )
    return WeightEstimate(total * 2.0, "bf16")


def target_context(config: dict) -> int | None:
    """The longest sequence the target's config.json allows (text config of a wrapper)."""
    text = config.get("text_config") or config
    value = text.get("max_position_embeddings") or config.get("max_position_embeddings")
    return int(value) if value else None


def hub_repo_id(value: str | None) -> str | None:
    """`value` if it names a hub repository, None for a folder, a file, a package or nothing."""
    if not value or value == "None":  # (MLflow records a null param as "None")
        return None
    if value.startswith(("package:", "miniature:", "/", ".", "~")) or Path(value).exists():
        return None
    return value


def target_hub_id(cfg: RunnerConfig) -> str | None:
    """model.hub_id, else model.source when it is a hub id (not a folder or a package)."""
    return cfg.model.hub_id or hub_repo_id(cfg.model.source)
