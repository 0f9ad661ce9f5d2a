"""The `transformers` backend of stage `extract`: the target in this process, with forward hooks.

Selected with `extract.backend=transformers` (the default). Hooks sit on the text model's decoder
layers as runner/assets/target_layout.py finds them (vLLM id k>0 is the output of layer k-1, id 0
the
input of layer 0). Rows are batched by length, padded on the right so real positions are
untouched; on a GPU, copies to the host, file writes and the next forward overlap. Before the
full run a one-sample self-test checks that the target's own final norm and LM head on the last
slot reproduce its next tokens (the last slot is the pre-norm final state).

Imported only when extraction runs: it imports torch at the top.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from runner.assets.loading import load_target
from runner.assets.target_facts import ModelFacts
from runner.assets.target_layout import decoder_layers, get_module, layout_from_model
from runner.core.layer_ids import hook_point
from runner.core.schema import RunnerConfig
from runner.engine.console import bar_interval
from runner.engine.stage import StageContext
from stages.extract.samples import LayerStats, write_sample

log = logging.getLogger("runner")


class TransformersBackend:
    """In-process Hugging Face forward with hooks on the text model's decoder layers."""

    def __init__(self, model: Any, capture_ids: tuple[int, ...], num_layers: int, batch_size: int):
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
                self._hooks.append(
                    self.layers[i].register_forward_pre_hook(self._pre_hook(lid), with_kwargs=True)
                )
            else:
                self._hooks.append(self.layers[i].register_forward_hook(self._post_hook(lid)))

    @classmethod
    def from_config(cls, cfg: RunnerConfig, facts: ModelFacts) -> TransformersBackend:
        hw = cfg.hardware
        model = load_target(facts.path, getattr(torch, hw.dtype), cfg.model.trust_remote_code)
        model = model.to(torch.device("cuda" if hw.device == "cuda" else "cpu"))
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
        self._captured.clear()
        with torch.inference_mode():
            logits = self.model(input_ids=ids[None].to(self.device), use_cache=False).logits[0]
            if sorted(self._captured) != sorted(self.ids):
                raise RuntimeError(
                    f"self-test: captured ids {sorted(self._captured)}, expected {list(self.ids)}"
                )
            final = self._captured[self.ids[-1]][0]
            norm = get_module(self.model, self.layout.norm)
            mine = get_module(self.model, self.layout.lm_head)(norm(final))
        agree = (mine.argmax(-1) == logits.argmax(-1)).float().mean().item()
        if agree < 0.98:
            raise RuntimeError(
                f"self-test: the target's head on the captured final slot agrees with its own next "
                f"tokens at only {agree:.1%} of positions; the last slot is not the pre-norm "
                "final state"
            )
        return {
            "selftest_slots": float(len(self._captured)),
            "selftest_next_token_agreement": agree,
        }

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    def forward(self, batch_ids: list[Any]) -> Any:
        """Stacked captures [batch, seq, slots, hidden] on the model's device, rows right-padded."""
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
            self.model(
                input_ids=input_ids.to(self.device, non_blocking=True),
                attention_mask=attn.to(self.device, non_blocking=True),
                use_cache=False,
                logits_to_keep=1,
            )
            return torch.stack([self._captured[lid] for lid in self.ids], dim=2)

    def iter_batches(
        self, rows: Sequence[Any], order: list[int], stats: LayerStats | None = None
    ) -> Iterator[tuple[list[int], list[int], Any, Any]]:
        """(row indices, lengths, host tensor [batch, seq, slots, hidden], release) per batch;
        the caller calls release() once nothing reads the host tensor any more.

        On a GPU the device-to-host copy of batch i goes into pinned memory on a side stream while
        batch i+1 computes; batch i is handed out only after batch i+1's forward is queued, so the
        copy, the caller's file writing and the next forward overlap. Statistics are reduced on
        the device, so only a few numbers per slot cross to the host for them.
        """
        cuda = self.device.type == "cuda"
        side = torch.cuda.Stream() if cuda else None
        free: list[
            Any
        ] = []  # pinned host buffers, reused: pinning memory costs far more than copying into it
        pending = None  # (idx, lengths, host, event, release)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
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
                release = functools.partial(free.append, buf)
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


def extract_to_files(
    backend: Any,
    rows: Sequence[Any],
    out_dir: Path,
    stats: LayerStats | None = None,
    writers: int = 8,
    progress: bool = True,
    storage: str = "bf16",
) -> dict[str, float]:
    """Run `backend` over `rows` (token id tensors), writing hs_{i}.safetensors for row i.

    Rows go longest first (similar lengths share a batch: less padding); files are written by a
    thread pool while the next batch computes, with at most a few batches in flight (bounded
    host memory). Returns tokens, seconds and tokens per second.
    """
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

    with (
        ThreadPoolExecutor(max_workers=writers) as pool,
        tqdm(
            total=total,
            desc="extract",
            unit="tok",
            unit_scale=True,
            disable=not progress,
            mininterval=bar_interval(),
        ) as bar,
    ):
        for idx, lens, host, release in backend.iter_batches(rows, order, stats):
            futures = [
                pool.submit(
                    write_sample, out_dir / f"hs_{i}.safetensors", host[r, :n], rows[i], storage
                )
                for r, (i, n) in enumerate(zip(idx, lens, strict=True))
            ]
            in_flight.append((futures, release))
            while len(in_flight) > 3:
                settle(in_flight.pop(0))
            bar.update(sum(lens))
        for batch in in_flight:
            settle(batch)
    seconds = time.time() - t0
    return {"tokens": float(total), "seconds": seconds, "tokens_per_s": total / seconds}


def extract(
    ctx: StageContext, rows: Sequence[Any], out_dir: Path, stats: LayerStats
) -> dict[str, Any]:
    """The target in this process: load, self-test on the shortest row, then every row."""
    t_load = time.time()
    backend = TransformersBackend.from_config(ctx.cfg, ctx.facts)
    load_s = time.time() - t_load
    shortest = min(range(len(rows)), key=lambda i: len(rows[i]))
    selftest = backend.self_test(rows[shortest])
    log.info("extract self-test passed: %s", selftest)
    try:
        # Statistics are taken from the full-precision batch; the files may be fp8.
        timing = extract_to_files(backend, rows, out_dir, stats, storage=ctx.cfg.extract.storage)
    finally:
        backend.close()
    return {**timing, "model_load_s": load_s, **selftest}
