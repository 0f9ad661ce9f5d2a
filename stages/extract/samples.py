"""What both extraction backends write: one sample's file in speculators' on-disk format, and
the running statistics of each captured layer (stages/extract/{transformers,vllm}_backend.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class LayerStats:
    """Running per-slot statistics over real (unpadded) positions.

    Accumulators live on the device the states come from and are read once at the end, so
    collecting them never stalls the GPU; each row is reduced as a view (no upcast copy of the
    batch), in float32 per row and float64 across rows.
    """

    def __init__(self, ids: tuple[int, ...]):
        self.ids = ids
        self.count = 0
        self._acc: dict[str, Any] | None = None

    def _init(self, device: Any) -> dict[str, Any]:
        import torch  # torch loads only when a stage computes statistics

        n = len(self.ids)

        def z() -> Any:
            return torch.zeros(n, dtype=torch.float64, device=device)

        return {
            "sum": z(),
            "sumsq": z(),
            "max": torch.full((n,), float("-inf"), dtype=torch.float64, device=device),
            "min": torch.full((n,), float("inf"), dtype=torch.float64, device=device),
            "nonfinite": z(),
        }

    def update_batch(self, stacked: Any, lengths: list[int]) -> None:
        """Add a batch [batch, seq, slots, hidden] whose row r is real up to lengths[r]."""
        import torch

        acc = self._acc = self._acc or self._init(stacked.device)
        for r, n in enumerate(lengths):
            x = stacked[r, :n]  # [seq, slots, hidden], a view
            s = x.sum(dim=(0, 2), dtype=torch.float32)
            sq = torch.linalg.vector_norm(x, dim=(0, 2), dtype=torch.float32) ** 2
            acc["sum"] += s.double()
            acc["sumsq"] += sq.double()
            acc["max"] = torch.maximum(acc["max"], x.amax(dim=(0, 2)).double())
            acc["min"] = torch.minimum(acc["min"], x.amin(dim=(0, 2)).double())
            # Non-finite values are rare; count them exactly (an extra pass) only when a row's
            # sum says so.
            bad = ~torch.isfinite(s + sq)
            acc["nonfinite"] += torch.where(bad, (~torch.isfinite(x)).sum(dim=(0, 2)).double(), 0.0)
            self.count += n * x.shape[2]

    def as_dict(self) -> dict[str, dict[str, float]]:
        acc = {k: v.cpu() for k, v in (self._acc or self._init("cpu")).items()}
        out = {}
        n = max(self.count, 1)
        for i, lid in enumerate(self.ids):
            mean = acc["sum"][i].item() / n
            ms = acc["sumsq"][i].item() / n
            out[f"layer_{lid}"] = {
                "mean": mean,
                "std": max(ms - mean * mean, 0.0) ** 0.5,
                "rms": ms**0.5,
                "max_abs": max(abs(acc["max"][i].item()), abs(acc["min"][i].item()))
                if self.count
                else 0.0,
                "nonfinite_fraction": acc["nonfinite"][i].item() / n,
            }
        return out


def write_sample(path: Path, hidden_states: Any, token_ids: Any, storage: str = "bf16") -> None:
    """One sample's file. fp8: hs-connectors' own quantizer and layout (`hidden_states` e4m3 and
    `hidden_states_scales` [seq, 1, 1] fp32), which speculators' fp8 backend dequantizes on
    load."""
    from safetensors.torch import save_file  # imports torch: only when a stage writes states

    tensors = {"hidden_states": hidden_states.contiguous(), "token_ids": token_ids.contiguous()}
    if storage == "fp8":
        from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

        fp8, scales = quantize_tensor_to_fp8(tensors["hidden_states"])
        tensors.update({"hidden_states": fp8, SCALES_KEY: scales})
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    tmp.rename(path)
