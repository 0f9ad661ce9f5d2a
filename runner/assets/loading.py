"""Loading a target's weights in this process with transformers (extraction's and
regeneration's transformers backends): a causal LM, or the multimodal wrapper around one.
"""

from __future__ import annotations

from typing import Any


def load_target(path: str, dtype: Any, trust_remote_code: bool) -> Any:
    """The target with its LM head: a causal LM, or a multimodal wrapper (Kimi-K2.5's
    KimiK25ForConditionalGeneration) that transformers registers as image-text-to-text only; the
    runner finds the text model's layers inside it either way (runner/assets/target_layout.py)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    kind = AutoModelForCausalLM
    if type(config) not in AutoModelForCausalLM._model_mapping and not getattr(
        config, "auto_map", {}
    ).get("AutoModelForCausalLM"):
        kind = AutoModelForImageTextToText
    return kind.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
