"""The vLLM backend's final-slot self-test: is the last captured slot the output of the last
decoder layer before the final norm (the vLLM convention's id n), as EAGLE-3 training needs?

Run by stages/extract/vllm_backend.py on sample 0, before the full extraction. The target's final
norm and LM head are applied to sample 0's last slot and must reproduce the target's own
next-token choices at (nearly) every decisive position (not a near tie), which the same server
reports as the top-1 of its prompt logprobs. A post-norm state (the norm applied twice) or a
slot one layer off does not.

Nothing loads the model here: only the final norm and LM-head tensors are read from the
checkpoint, through `model.safetensors.index.json` when the checkpoint is sharded, each tensor
alone (safetensors reads one tensor without the rest of its shard). For Kimi-K2.5 that is the
LM head, 163,840 x 7,168 in bf16 (2.3 GB), instead of 550 GB of weights.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from runner.core.errors import StageError

# At least this share of the decisive positions must agree. A position is decisive when its top
# two logits are apart by more than DECISIVE_GAP of that position's logit spread: a near tie is
# flipped by bf16 rounding alone and proves nothing (a random-weight target is mostly near ties;
# on the Kimi-K2.5 miniature the right slot agrees at 100% of decisive positions, a post-norm
# slot at 34-70%, a slot one layer off at under 10%).
MIN_AGREEMENT = 0.95
DECISIVE_GAP = 0.1
MIN_DECISIVE = 16
_SKIP = ("layers.", "blocks.", "vision", "mm_projector", "visual", "audio")


def _file(source: str, name: str) -> Path | None:
    """A file of the checkpoint: in the local folder, or the hub's (cached) copy of that file
    alone; None if it has no such file."""
    local = Path(source)
    if local.is_dir():
        return local / name if (local / name).is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(source, name))
    except EntryNotFoundError:
        return None


def _weight_map(source: str) -> dict[str, str]:
    """Tensor name -> shard file, from the safetensors index, or the single file's header."""
    index = _file(source, "model.safetensors.index.json")
    if index is not None:
        return json.loads(index.read_text())["weight_map"]
    from safetensors import safe_open

    single = _file(source, "model.safetensors")
    if single is None:
        raise StageError(f"final-slot self-test: {source} has no safetensors checkpoint")
    with safe_open(str(single), "pt") as f:
        return dict.fromkeys(f.keys(), single.name)


def _pick(names: list[str], suffix: str) -> str | None:
    """The text model's tensor ending in `suffix` (not a decoder layer's, not the vision
    tower's); None if there is none or it is ambiguous."""
    found = [n for n in names if n.endswith(suffix) and not any(s in n for s in _SKIP)]
    return found[0] if len(found) == 1 else None


def head_tensors(source: str) -> tuple[Any, Any, int]:
    """(final norm weight, LM head weight, bytes read): only those two tensors are read."""
    from safetensors import safe_open

    weights = _weight_map(source)
    names = list(weights)
    norm = _pick(names, ".norm.weight")
    head = _pick(names, "lm_head.weight") or _pick(names, "embed_tokens.weight")  # tied head
    if norm is None or head is None:
        raise StageError(
            f"final-slot self-test: could not tell the final norm ({norm}) and LM head ({head}) "
            f"among the checkpoint's tensors in {source}"
        )
    out = []
    for name in (norm, head):
        shard = _file(source, weights[name])
        assert shard is not None, weights[name]
        with safe_open(str(shard), "pt") as f:
            out.append(f.get_tensor(name))
    return out[0], out[1], sum(t.numel() * t.element_size() for t in out)


def prompt_top1(server: Any, ids: list[int], timeout: float) -> list[int]:
    """The target's own greedy next token after each prefix of `ids` (position t predicts
    ids[t + 1]), from the server's prompt logprobs."""
    import openai

    client = openai.OpenAI(base_url=server.url, api_key="EMPTY", max_retries=0)
    out = client.completions.create(
        model=server.model_id,
        prompt=ids,
        max_tokens=1,
        timeout=timeout,
        extra_body={"prompt_logprobs": 1},
    )
    # An extraction server writes this request's states too: remove them (on a server the
    # runner did not start they would stay in its shared folder).
    written = (out.model_extra or {}).get("kv_transfer_params") or {}
    if written.get("hidden_states_path"):
        from hs_connectors.transfer import wait_for_lock

        path = Path(written["hidden_states_path"])
        if Path(f"{path}.lock").exists():
            wait_for_lock(f"{path}.lock")
        path.unlink(missing_ok=True)
    per_pos = out.choices[0].model_extra.get("prompt_logprobs") or []
    return [
        int(min(d.items(), key=lambda kv: kv[1].get("rank", 1 << 30))[0]) for d in per_pos[1:] if d
    ]


def norm_eps(source: str) -> float:
    """The text model's RMSNorm epsilon from config.json."""
    path = _file(source, "config.json")
    config = json.loads(path.read_text()) if path else {}
    text = config.get("text_config") or config
    return float(text.get("rms_norm_eps") or config.get("rms_norm_eps") or 1e-6)


def check(
    source: str, final_slot: Any, target_top1: list[int], eps: float, final_id: int
) -> dict[str, float]:
    """Raise StageError unless norm + head on `final_slot` ([seq, hidden]) reproduce
    `target_top1` (seq - 1 tokens); return the measurements."""
    import torch

    t0 = time.time()
    norm_w, head_w, read = head_tensors(source)
    x = final_slot.float()[: len(target_top1)]
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_w.float()
    logits = normed @ head_w.float().T
    top2 = logits.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > DECISIVE_GAP * logits.std(dim=-1)
    if int(decisive.sum()) < MIN_DECISIVE:
        decisive = torch.ones_like(decisive)
    same = logits.argmax(-1) == torch.tensor(target_top1)
    agree = same[decisive].float().mean().item()
    seconds = time.time() - t0
    if agree < MIN_AGREEMENT:
        raise StageError(
            f"final-slot self-test: the target's final norm and LM head applied to the last "
            f"captured slot (vLLM id {final_id}) reproduce the target's next tokens at only "
            f"{agree:.1%} of sample 0's decisive positions (at least {MIN_AGREEMENT:.0%} "
            "expected). The last slot is not the output of the last decoder layer before the "
            "final norm: check model.capture_layers and the layer-id convention (vLLM: id k = "
            f"input of decoder layer k, id {final_id} = the last layer's output before the norm), "
            "and any "
            "--speculative-config in hardware.vllm.extra_args"
        )
    return {
        "selftest_next_token_agreement": agree,
        "selftest_bytes_read": float(read),
        "selftest_s": seconds,
        "selftest_positions": float(int(decisive.sum())),
        "selftest_agreement_all_positions": same.float().mean().item(),
    }
