"""Model adapters: where a target's text model, decoder layers, final norm, embedding and LM head
live, and its numbers, for plain causal LMs and multimodal wrappers alike.

Two entry points return the same `TargetLayout`:
- `layout_from_config(config_json_dict, override)`: from config.json alone, no weights, no remote
  code. The text model is built on the meta device from `text_config` (or the top-level config)
  and its structure discovered; a wrapper's prefix comes from transformers' own wrapper class
  when transformers knows it, else from `WRAPPER_PREFIXES` (e.g. Kimi-K2.5, whose code lives
  on the hub), else from the `model.layout` override in conf/model/*.yaml.
  A 1T-parameter DeepSeek-V3 text model builds on meta in about 0.4 s.
- `layout_from_model(model)`: structural discovery on a loaded (or meta) model.

Discovery is by structure, not class name: the decoder layers are the shortest-path
`nn.ModuleList` named `layers` with the text config's layer count, outside vision/audio towers;
the norm and embedding are its siblings; the LM head is the `lm_head` whose output is the vocab.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

_VISION_HINTS = ("vision", "visual", "image", "audio", "mm_projector", "multi_modal", "projector")

# Wrappers whose class transformers does not ship: architecture -> (text model prefix, lm_head path)
# as their checkpoints name them. Kimi-K2.5 weights: language_model.model.layers.{0..60},
# language_model.model.norm, language_model.lm_head.
WRAPPER_PREFIXES: dict[str, tuple[str, str]] = {
    "KimiK25ForConditionalGeneration": ("language_model.model", "language_model.lm_head"),
    "KimiVLForConditionalGeneration": ("language_model.model", "language_model.lm_head"),
    "DeepseekVLV2ForCausalLM": ("language.model", "language.lm_head"),
}

# Text model_types that transformers knows under another name (read fields, don't branch on them).
TEXT_MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3", "kimi_k25": "deepseek_v3"}


@dataclass(frozen=True)
class TargetLayout:
    architecture: str
    wrapper: bool
    text_model: str  # dotted path of the text model ("" = the root)
    layers: str
    norm: str
    embed: str
    lm_head: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_experts: int  # routed experts per MoE layer (0 = dense)
    experts_per_token: int
    tie_word_embeddings: bool
    text_params: int  # parameters of the text model (incl. embedding and head)
    source: str  # how the paths were found: "transformers", "registry", "override" or "model"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def get_module(module: Any, path: str) -> Any:
    for part in filter(None, path.split(".")):
        module = getattr(module, part)
    return module


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def find_layers(model: Any, num_layers: int | None = None) -> tuple[str, Any]:
    import torch.nn as nn  # torch and transformers load only when a layout is discovered

    candidates = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or name.rsplit(".", 1)[-1] != "layers":
            continue
        if any(h in name.lower() for h in _VISION_HINTS):
            continue
        if num_layers is None or len(module) == num_layers:
            candidates.append((name, module))
    if not candidates:
        found = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
        raise ValueError(
            f"no text decoder layer list{f' of length {num_layers}' if num_layers else ''} in "
            f"{type(model).__name__}; module lists: {found[:10]}. Set model.layout in conf/model."
        )
    return min(candidates, key=lambda nm: nm[0].count("."))


def decoder_layers(model: Any, num_layers: int) -> Any:
    return find_layers(model, num_layers)[1]


def _text_config(model: Any) -> Any:
    cfg = model.config
    return (
        cfg.get_text_config()
        if hasattr(cfg, "get_text_config")
        else getattr(cfg, "text_config", cfg)
    )


def layout_from_model(model: Any, source: str = "model") -> TargetLayout:
    tc = _text_config(model)
    layers_path, layers = find_layers(model, getattr(tc, "num_hidden_layers", None))
    text_model = layers_path.rsplit(".", 1)[0] if "." in layers_path else ""
    text = get_module(model, text_model)
    norm = next((n for n in ("norm", "final_layernorm", "ln_f") if hasattr(text, n)), None)
    embed = next((n for n in ("embed_tokens", "wte", "tok_embeddings") if hasattr(text, n)), None)
    vocab = tc.vocab_size
    heads = [
        n
        for n, m in model.named_modules()
        if n.rsplit(".", 1)[-1] in ("lm_head", "output")
        and getattr(m, "out_features", None) == vocab
    ]
    if norm is None or embed is None or not heads:
        raise ValueError(
            f"{type(model).__name__}: text model at '{text_model}' lacks a final norm, "
            "embedding or "
            f"LM head (norm={norm}, embed={embed}, heads={heads}); set model.layout in conf/model"
        )
    lm_head = min(heads, key=lambda n: n.count("."))
    return TargetLayout(
        architecture=type(model).__name__,
        wrapper=hasattr(model.config, "text_config") or text_model.count(".") > 0,
        text_model=text_model,
        layers=layers_path,
        norm=_join(text_model, norm),
        embed=_join(text_model, embed),
        lm_head=lm_head,
        num_layers=len(layers),
        hidden_size=tc.hidden_size,
        vocab_size=vocab,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
        num_experts=int(
            getattr(tc, "n_routed_experts", None)
            or getattr(tc, "num_local_experts", None)
            or getattr(tc, "num_experts", None)
            or 0
        ),
        experts_per_token=int(getattr(tc, "num_experts_per_tok", None) or 0),
        tie_word_embeddings=bool(getattr(tc, "tie_word_embeddings", False)),
        text_params=sum(p.numel() for p in get_module(model, text_model).parameters())
        + (
            0
            if getattr(tc, "tie_word_embeddings", False)
            else get_module(model, lm_head).weight.numel()
        ),
        source=source,
    )


def _build_meta(config: Any, causal_lm: bool) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    with torch.device("meta"):
        if causal_lm:
            return AutoModelForCausalLM.from_config(config)
        try:
            return AutoModelForImageTextToText.from_config(config)
        except ValueError:
            return AutoModelForCausalLM.from_config(config)


def _known_to_transformers(model_type: str | None) -> bool:
    from transformers import CONFIG_MAPPING

    return bool(model_type) and model_type in CONFIG_MAPPING


def layout_from_config(
    config: dict[str, Any], override: dict[str, str] | None = None
) -> TargetLayout:
    """The layout of a target from its config.json contents alone (nothing downloaded, no
    remote code)."""
    from transformers import AutoConfig

    override = {k: v for k, v in (override or {}).items() if v}
    arch = (config.get("architectures") or ["unknown"])[0]
    clean = {
        k: v
        for k, v in config.items()
        if k not in ("auto_map", "quantization_config", "architectures")
    }
    model_type = clean.get("model_type")
    if _known_to_transformers(model_type) and arch not in WRAPPER_PREFIXES:
        hf = AutoConfig.for_model(**clean)
        hf.architectures = [arch]
        layout = layout_from_model(
            _build_meta(hf, causal_lm=not hasattr(hf, "text_config")), source="transformers"
        )
        if arch != "unknown":
            layout = dataclasses.replace(layout, architecture=arch)
    else:
        # A wrapper transformers does not ship (or a custom model_type): build its text model.
        text = dict(clean.get("text_config") or clean)
        text_type = TEXT_MODEL_TYPE_ALIASES.get(text.get("model_type"), text.get("model_type"))
        if not _known_to_transformers(text_type):
            raise ValueError(
                f"config model_type {model_type!r} (text {text.get('model_type')!r}) is unknown to "
                "transformers; set model.layout in conf/model and the text fields by hand"
            )
        text["model_type"] = text_type
        text.pop("auto_map", None)
        hf_text = AutoConfig.for_model(**text)
        inner = layout_from_model(_build_meta(hf_text, causal_lm=True), source="registry")
        if arch in WRAPPER_PREFIXES:
            prefix, lm_head = WRAPPER_PREFIXES[arch]
        elif "text_config" in clean:
            if "text_model" not in override:
                raise ValueError(
                    f"wrapper {arch} is unknown to transformers and to the runner's registry; "
                    "set model.layout.text_model and model.layout.lm_head in conf/model"
                )
            prefix, lm_head = override["text_model"], override.get("lm_head", "lm_head")
        else:
            prefix, lm_head = inner.text_model, inner.lm_head

        def rename(p: str) -> str:
            inside = p.startswith(inner.text_model + ".")
            return _join(prefix, p.split(".", 1)[1] if inside else p)

        layout = dataclasses.replace(
            inner,
            architecture=arch,
            wrapper="text_config" in clean,
            text_model=prefix,
            layers=rename(inner.layers),
            norm=rename(inner.norm),
            embed=rename(inner.embed),
            lm_head=lm_head,
        )
    if override:
        fields = {
            k: v
            for k, v in override.items()
            if k in ("text_model", "layers", "norm", "embed", "lm_head")
        }
        if fields.get("text_model") and "layers" not in fields:
            tm = fields["text_model"]
            fields.update(layers=f"{tm}.layers", norm=f"{tm}.norm", embed=f"{tm}.embed_tokens")
        layout = dataclasses.replace(layout, **fields, source="override")
    return layout
