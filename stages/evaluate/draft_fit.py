"""A draft trained elsewhere (`eval.draft`) held against this run's target in the plan, from
its config.json and its weights' header alone, before any server starts: a draft made for
another target otherwise fails with an HTTP 500 after the target has loaded (minutes; half an
hour for Kimi-K2.5), naming nothing.

    problems = misfits(Path(draft), target.layout)    # [] when it fits
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runner.assets.target_layout import TargetLayout
from runner.assets.weights import header
from runner.integrations.vllm import aux_count_problem


def misfits(draft: Path, layout: TargetLayout) -> list[str]:
    """What in `draft` does not fit the target: its hidden size, its vocabulary mapping (t2d
    spans the target's vocabulary, d2t the draft's), its embedding, and the layers it reads
    (eagle_aux_hidden_state_layer_ids must be layers of the target, and as many as vLLM will
    build its fc layer for)."""
    try:
        conf: dict[str, Any] = json.loads((draft / "config.json").read_text())
        shapes = {
            n: list(i.get("shape", [])) for n, i in header(draft / "model.safetensors").items()
        }
    except (OSError, ValueError) as exc:
        return [f"cannot read {draft}: {exc}"]
    out = []
    n, hidden, vocab = layout.num_layers, layout.hidden_size, layout.vocab_size
    layer = conf.get("transformer_layer_config") or {}
    own_hidden = layer.get("hidden_size")
    if own_hidden is not None and own_hidden != hidden:
        out.append(f"its hidden size is {own_hidden}, the target's {hidden}")
    t2d = shapes.get("t2d")
    if t2d and t2d != [vocab]:
        out.append(f"its t2d maps a vocabulary of {t2d[0]} tokens, the target has {vocab}")
    embed = shapes.get("embed_tokens.weight")
    if embed and embed != [vocab, hidden]:
        out.append(
            f"its embed_tokens is {embed[0]} x {embed[1]}, the target's is {vocab} x {hidden}"
        )
    d2t, head = shapes.get("d2t"), shapes.get("lm_head.weight")
    if d2t and head and d2t[0] != head[0]:
        out.append(f"its d2t maps {d2t[0]} draft tokens, its lm_head has {head[0]} rows")
    aux = conf.get("eagle_aux_hidden_state_layer_ids") or []
    outside = [i for i in aux if not isinstance(i, int) or not 0 <= i < n]
    if outside:
        out.append(
            f"it reads layer ids {outside} (eagle_aux_hidden_state_layer_ids), outside the "
            f"target's {n} layers"
        )
    fc = aux_count_problem(conf)
    if fc:
        out.append(fc)
    return out
