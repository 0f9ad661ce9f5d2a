"""Stage `extract`: hidden states of the capture layers for every prepared row, in speculators' format.

Run alone: `python -m runner run.stages=[extract]` (prepare must be in the store or run too).
Writes `hidden_states/hs_{i}.safetensors` for row i of the prepared dataset, each holding
`hidden_states` [seq, n_capture, hidden] (the last slot is the final decoder layer's output
before the final norm) and `token_ids` [seq], plus `layer_stats.json`.

Backends sit behind `BACKENDS`; each takes the prepared rows and yields (row index, hidden states)
so that file writing and statistics are shared. `transformers` runs the target in process with
forward hooks on its decoder layers (vLLM id k>0 is the output of layer k-1, id 0 the input of
layer 0), batched by length, padding on the right so real positions are untouched.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

NAME = "extract"
UPSTREAM = ("prepare",)
VERSION = "1"
LIBRARIES = {"torch": ("torch",), "transformers": ("transformers",)}

log = logging.getLogger("runner")


def key_config(cfg: Any, facts: Any) -> dict[str, Any]:
    return {
        "weights": facts.weights_id,
        "capture_ids": list(facts.extract_ids),
        "dtype": cfg.hardware.dtype,
        "backend": cfg.extract.backend,
    }


class LayerStats:
    """Running per-slot statistics over real (unpadded) positions, in float64."""

    def __init__(self, ids: tuple[int, ...]):
        import torch

        self.ids = ids
        n = len(ids)
        self.count = 0
        self.sum = torch.zeros(n, dtype=torch.float64)
        self.sumsq = torch.zeros(n, dtype=torch.float64)
        self.maxabs = torch.zeros(n, dtype=torch.float64)
        self.nonfinite = torch.zeros(n, dtype=torch.float64)

    def update(self, hs: Any) -> None:
        import torch

        x = hs.double()  # [seq, slots, hidden]
        finite = torch.isfinite(x)
        self.nonfinite += (~finite).sum(dim=(0, 2)).double()
        x = torch.where(finite, x, torch.zeros((), dtype=x.dtype))
        self.count += x.shape[0] * x.shape[2]
        self.sum += x.sum(dim=(0, 2))
        self.sumsq += (x * x).sum(dim=(0, 2))
        self.maxabs = torch.maximum(self.maxabs, x.abs().amax(dim=(0, 2)))

    def as_dict(self) -> dict[str, dict[str, float]]:
        out = {}
        for i, lid in enumerate(self.ids):
            n = max(self.count, 1)
            mean = self.sum[i].item() / n
            ms = self.sumsq[i].item() / n
            out[f"layer_{lid}"] = {
                "mean": mean, "std": max(ms - mean * mean, 0.0) ** 0.5, "rms": ms ** 0.5,
                "max_abs": self.maxabs[i].item(), "nonfinite_fraction": self.nonfinite[i].item() / n,
            }
        return out


def write_sample(path: Path, hidden_states: Any, token_ids: Any) -> None:
    from safetensors.torch import save_file

    tmp = path.with_suffix(".tmp")
    save_file({"hidden_states": hidden_states.contiguous(), "token_ids": token_ids.contiguous()}, str(tmp))
    tmp.rename(path)


class TransformersBackend:
    """In-process Hugging Face forward with hooks on the text model's decoder layers."""

    def __init__(self, cfg: Any, facts: Any):
        import torch
        from transformers import AutoModelForCausalLM

        from runner.adapters import decoder_layers, layout_from_model
        from runner.layer_ids import hook_point

        hw = cfg.hardware
        self.device = torch.device("cuda" if hw.device == "cuda" else "cpu")
        self.dtype = getattr(torch, hw.dtype)
        self.batch_size = hw.extract_batch_size
        self.model = AutoModelForCausalLM.from_pretrained(
            facts.path, dtype=self.dtype, trust_remote_code=cfg.model.trust_remote_code
        ).to(self.device).eval()
        self.layers = decoder_layers(self.model, facts.num_layers)
        self.layout = layout_from_model(self.model)
        self.ids = facts.extract_ids
        self._captured: dict[int, Any] = {}
        self._hooks = []
        for lid in self.ids:
            where, i = hook_point(lid, facts.num_layers)
            if where == "pre":
                self._hooks.append(self.layers[i].register_forward_pre_hook(self._pre_hook(lid), with_kwargs=True))
            else:
                self._hooks.append(self.layers[i].register_forward_hook(self._post_hook(lid)))

    def _pre_hook(self, lid: int):
        def hook(_module, args, kwargs):
            self._captured[lid] = args[0] if args else kwargs["hidden_states"]
        return hook

    def _post_hook(self, lid: int):
        def hook(_module, _args, output):
            self._captured[lid] = output[0] if isinstance(output, tuple) else output
        return hook

    def self_test(self, ids: Any) -> dict[str, float]:
        """One sample before the full run: the right number of slots, and the target's own final
        norm and LM head applied to the last slot reproduce the target's next-token choices (so
        the last slot is the pre-norm final state, not one layer off and not post-norm)."""
        import torch

        from runner.adapters import _get

        self._captured.clear()
        with torch.inference_mode():
            logits = self.model(input_ids=ids[None].to(self.device), use_cache=False).logits[0]
            if sorted(self._captured) != sorted(self.ids):
                raise RuntimeError(f"self-test: captured ids {sorted(self._captured)}, expected {list(self.ids)}")
            final = self._captured[self.ids[-1]][0]
            mine = _get(self.model, self.layout.lm_head)(_get(self.model, self.layout.norm)(final))
        agree = (mine.argmax(-1) == logits.argmax(-1)).float().mean().item()
        if agree < 0.98:
            raise RuntimeError(f"self-test: the target's head on the captured final slot agrees with its own next "
                               f"tokens at only {agree:.1%} of positions; the last slot is not the pre-norm final state")
        return {"selftest_slots": float(len(self._captured)), "selftest_next_token_agreement": agree}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    def forward(self, batch_ids: list[Any]) -> Any:
        """Stacked captures [batch, seq, slots, hidden] for right-padded rows."""
        import torch

        lengths = [len(x) for x in batch_ids]
        width = max(lengths)
        input_ids = torch.zeros(len(batch_ids), width, dtype=torch.long)
        attn = torch.zeros(len(batch_ids), width, dtype=torch.long)
        for r, ids in enumerate(batch_ids):
            input_ids[r, : len(ids)] = ids
            attn[r, : len(ids)] = 1
        self._captured.clear()
        with torch.inference_mode():
            # logits_to_keep=1: the LM head over the whole vocab is not needed for extraction.
            self.model(input_ids=input_ids.to(self.device), attention_mask=attn.to(self.device),
                       use_cache=False, logits_to_keep=1)
        return torch.stack([self._captured[lid] for lid in self.ids], dim=2)

    def iter_hidden_states(self, rows: Any, order: list[int]) -> Iterator[tuple[int, Any]]:
        for start in range(0, len(order), self.batch_size):
            idx = order[start: start + self.batch_size]
            ids = [rows[i]["input_ids"] for i in idx]
            stacked = self.forward(ids).to("cpu", dtype=self.dtype)
            for r, i in enumerate(idx):
                yield i, stacked[r, : len(ids[r])]


BACKENDS = {"transformers": TransformersBackend}


def run(ctx: Any) -> dict[str, Any]:
    import datasets
    import torch
    from tqdm import tqdm

    cfg = ctx.cfg
    if cfg.hardware.cpu_threads:
        torch.set_num_threads(cfg.hardware.cpu_threads)
    backend_name = cfg.extract.backend
    if backend_name not in BACKENDS:
        from runner.errors import ConfigError

        raise ConfigError("extract.backend", f"'{backend_name}' is not one of {sorted(BACKENDS)}")
    rows = datasets.load_from_disk(str(ctx.inputs["prepare"].path / "dataset"))
    rows.set_format("torch")
    lengths = [int(x) for x in rows.with_format(None)["seq_len"]]
    # Longest first: similar lengths share a batch (less padding) and memory peaks early.
    order = sorted(range(len(rows)), key=lambda i: -lengths[i])
    out_dir = ctx.out / "hidden_states"
    out_dir.mkdir()
    t_load = time.time()
    backend = BACKENDS[backend_name](cfg, ctx.facts)
    load_s = time.time() - t_load
    selftest = backend.self_test(rows[order[-1]]["input_ids"]) if hasattr(backend, "self_test") else {}
    log.info("extract self-test passed: %s", selftest)
    stats = LayerStats(ctx.facts.extract_ids)
    total_tokens = sum(lengths)
    t0 = time.time()
    pending: list[Future] = []
    # Files are written by a small thread pool while the next batch computes; the bound on
    # pending writes caps host memory.
    with ThreadPoolExecutor(max_workers=2) as pool, tqdm(total=total_tokens, desc="extract", unit="tok", unit_scale=True) as bar:
        for i, hs in backend.iter_hidden_states(rows, order):
            stats.update(hs)
            token_ids = rows[i]["input_ids"]
            if hs.shape[0] != token_ids.shape[0]:
                raise RuntimeError(f"row {i}: captured {hs.shape[0]} positions for {token_ids.shape[0]} tokens")
            pending.append(pool.submit(write_sample, out_dir / f"hs_{i}.safetensors", hs, token_ids))
            if len(pending) > 4 * cfg.hardware.extract_batch_size:
                pending.pop(0).result()
            bar.update(int(hs.shape[0]))
        for f in pending:
            f.result()
    backend.close()
    seconds = time.time() - t0
    layer_stats = stats.as_dict()
    (ctx.out / "layer_stats.json").write_text(json.dumps(layer_stats, indent=2))
    # Which vLLM layer id each slot of the files holds (train selects its own from these).
    (ctx.out / "capture_ids.json").write_text(json.dumps(list(ctx.facts.extract_ids)))
    written = sum(p.stat().st_size for p in out_dir.iterdir())
    return {
        "samples": len(rows), "tokens": total_tokens, "tokens_per_s": total_tokens / seconds,
        "model_load_s": load_s, "extract_s": seconds, "bytes": written,
        "bytes_per_token": written / total_tokens, "slots": len(ctx.facts.extract_ids), **selftest,
        **{f"{layer}/{name}": v for layer, st in layer_stats.items() for name, v in st.items()},
    }
