"""The export check: is the draft folder training published the draft that was trained, in the
shape vLLM will read it? Run by the train stage before it publishes; a broken export fails there,
not half an hour later in a server that will not load it or drafts nonsense.

    report = check_draft(draft_dir, vocab_dir, expect)    # Report(lines, problems, metrics)

Checks, from the folder's own files (config.json, model.safetensors) against what the run asked:
- the output head: `lm_head.weight` of [draft vocab, hidden], or embeddings tied explicitly;
- the vocabulary mapping: d2t [draft vocab] and t2d [target vocab] in the weights, consistent
  with each other and equal (sha256) to the vocab stage's d2t.npy / t2d.npy;
- each draft layer's attention (layer_types, sliding_window) as train.* set it;
- the capture ids in both conventions: the config's aux ids (speculators' and vLLM's
  `eagle_aux_hidden_state_layer_ids`) and the runner's capture ids with the final layer.
The validation pass over the reloaded folder (runner/integrations/speculators.py,
`validate_export`) adds the agreement of its accuracy with training's own.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Expected:
    draft_vocab_size: int
    target_vocab_size: int
    hidden_size: int
    num_layers: int
    sliding_window: int
    full_attention_layers: list[int]
    aux_layers: list[int]
    capture_ids: list[int]


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)


def _sha(array: Any) -> str:
    return hashlib.sha256(array.tobytes()).hexdigest()


def check_draft(draft: Path, vocab: Path, expect: Expected) -> Report:
    import numpy as np
    from safetensors import safe_open

    r = Report()
    conf = json.loads((draft / "config.json").read_text())
    with safe_open(str(draft / "model.safetensors"), "pt") as fh:
        names = set(fh.keys())
        shape = {n: list(fh.get_slice(n).get_shape()) for n in names}
        d2t = fh.get_tensor("d2t").numpy() if "d2t" in names else None
        t2d = fh.get_tensor("t2d").numpy() if "t2d" in names else None
    dv, tv = expect.draft_vocab_size, expect.target_vocab_size
    layer = conf.get("transformer_layer_config", {})
    h = int(layer.get("hidden_size", expect.hidden_size))

    # The output head.
    if "lm_head.weight" in names:
        ok = shape["lm_head.weight"] == [dv, h]
        r.lines.append(f"lm_head {shape['lm_head.weight']} (draft vocab x hidden)")
        if not ok:
            r.problems.append(f"lm_head.weight is {shape['lm_head.weight']}, not [{dv}, {h}]")
    elif conf.get("tie_word_embeddings") and "embed_tokens.weight" in names:
        r.lines.append("lm_head tied to embed_tokens (tie_word_embeddings)")
    else:
        r.problems.append("no lm_head.weight and the embeddings are not tied: vLLM has no head")

    # The vocabulary mapping, against the vocab stage's files.
    if d2t is None or t2d is None:
        r.problems.append("d2t / t2d are not in model.safetensors: vLLM cannot map draft tokens")
    else:
        mine_d2t, mine_t2d = np.load(vocab / "d2t.npy"), np.load(vocab / "t2d.npy")
        if list(d2t.shape) != [dv] or list(t2d.shape) != [tv]:
            r.problems.append(f"d2t {list(d2t.shape)} / t2d {list(t2d.shape)}, not [{dv}] / [{tv}]")
        else:
            targets = np.arange(dv) + d2t
            inside = (targets >= 0) & (targets < tv)
            if int(t2d.sum()) != dv or not inside.all() or not t2d[targets[inside]].all():
                r.problems.append("d2t and t2d disagree: a draft token maps outside t2d's set")
            same = _sha(d2t.astype(mine_d2t.dtype)) == _sha(mine_d2t) and _sha(
                t2d.astype(mine_t2d.dtype)
            ) == _sha(mine_t2d)
            if not same:
                r.problems.append("d2t / t2d differ from the vocab stage's d2t.npy / t2d.npy")
            r.lines.append(
                f"d2t [{dv}] sha256 {_sha(mine_d2t)[:12]}, t2d [{tv}] sha256 "
                f"{_sha(mine_t2d)[:12]}: {'equal to' if same else 'NOT'} the vocab stage's"
            )

    # Each layer's attention.
    types = layer.get("layer_types") or []
    want = [
        "full_attention" if i in expect.full_attention_layers else "sliding_attention"
        for i in range(expect.num_layers)
    ]
    if types != want:
        r.problems.append(f"layer_types {types}, not {want} (train.full_attention_layers)")
    if "sliding_attention" in want and layer.get("sliding_window") != expect.sliding_window:
        r.problems.append(
            f"sliding_window {layer.get('sliding_window')}, not {expect.sliding_window} "
            "(train.sliding_window)"
        )
    r.lines.append(f"layers {types}, window {layer.get('sliding_window')}")

    # The capture ids, in both conventions.
    aux = conf.get("eagle_aux_hidden_state_layer_ids")
    if aux != list(expect.aux_layers):
        r.problems.append(
            f"eagle_aux_hidden_state_layer_ids {aux}, not {expect.aux_layers} (the layers the "
            "draft was trained on): vLLM would feed it other layers"
        )
    r.lines.append(
        f"aux layer ids {aux} (the config's, speculators' and vLLM's convention); capture ids "
        f"{expect.capture_ids} (the runner's, with the final layer before the norm)"
    )
    r.metrics["export_problems"] = len(r.problems)
    return r
