"""Finding a target's text decoder layers, for hooks, whatever wrapper class holds them.

`decoder_layers(model, num_layers)` returns the `nn.ModuleList` of the language model's decoder
layers: plain causal LMs (`model.layers`) and multimodal wrappers (`language_model.model.layers`,
`model.language_model.layers`, ...) alike, by structure rather than by class name, skipping vision
towers that also have a `layers` list.
"""

from __future__ import annotations

from typing import Any

_VISION_HINTS = ("vision", "visual", "image", "audio", "mm_projector", "multi_modal")


def decoder_layers(model: Any, num_layers: int) -> Any:
    import torch.nn as nn

    candidates = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or name.rsplit(".", 1)[-1] != "layers":
            continue
        if any(h in name.lower() for h in _VISION_HINTS):
            continue
        candidates.append((name, module))
    exact = [(n, m) for n, m in candidates if len(m) == num_layers]
    if not exact:
        found = ", ".join(f"{n} ({len(m)})" for n, m in candidates) or "none"
        raise ValueError(
            f"no decoder layer list of length {num_layers} in {type(model).__name__}; "
            f"layer lists found: {found}. Check model.num_layers."
        )
    # The shortest path is the text model's own list (deeper ones belong to sub-modules).
    return min(exact, key=lambda nm: nm[0].count("."))[1]
