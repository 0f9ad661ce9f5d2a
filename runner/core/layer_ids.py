"""Layer ids: the one convention configs use, and conversions to what each tool needs.

Configs use the vLLM / speculators convention. For a target with n decoder layers:
    id 0      the embedding output (the input of decoder layer 0)
    id k      the residual stream entering decoder layer k = the output of layer k-1 (1 <= k < n)
    id n      the output of the last decoder layer, BEFORE the final norm
The "output-of" convention (EAGLE paper, ModelOpt, NeMo) calls id k "layer k-1"; older SGLang /
SpecForge configs write output-of ids and add 1 internally. transformers' `hidden_states[k]`
equals id k for k < n, but `hidden_states[n]` is AFTER the final norm, so the last slot must be
captured with a hook on the last decoder layer.
"""

from __future__ import annotations


def capture_ids(aux: list[int] | tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """Auxiliary ids plus the final pre-norm id n, as vLLM's eagle_aux_hidden_state_layer_ids."""
    return (*aux, num_layers)


def to_output_of(ids: list[int] | tuple[int, ...]) -> list[int]:
    """vLLM ids -> output-of ids (-1 = the embedding output)."""
    return [k - 1 for k in ids]


def from_output_of(ids: list[int] | tuple[int, ...]) -> list[int]:
    """Output-of ids -> vLLM ids."""
    return [k + 1 for k in ids]


def hook_point(k: int, num_layers: int) -> tuple[str, int]:
    """Where a transformers forward hook captures vLLM id k: ("pre", i) = the input of decoder
    layer i, ("post", i) = the output of decoder layer i (before any final norm)."""
    if not 0 <= k <= num_layers:
        raise ValueError(f"layer id {k} is outside 0..{num_layers}")
    return ("pre", 0) if k == 0 else ("post", k - 1)


def default_aux_layers(n: int) -> list[int]:
    """speculators' and vLLM's default EAGLE-3 aux layers: [2, n//2, n-3]."""
    return [2, n // 2, n - 3]


# Named layer choices derived from the layer count n (`model.capture_preset`), so one sweep file
# fits SmolLM2 (n=30) and Kimi-K2.5 (n=61) alike.
CAPTURE_PRESETS = {
    "default": default_aux_layers,
    "early": lambda n: [1, n // 4, n // 2],
    "late": lambda n: [n // 2, (3 * n) // 4, n - 2],
    "four": lambda n: [2, n // 3, (2 * n) // 3, n - 3],
}
