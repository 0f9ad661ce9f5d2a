"""This CPU's speed, measured in about a second, and the workload a CPU run's plan estimates.

    speed = probe("float32", threads=2, hidden=576, ffn=1536, draft_vocab=8192)
    speed.target_gflops, speed.draft_gflops, speed.gram_gflops
    work = Workload(speed, rows=1516, tokens=370_000, epochs=2)
    stage.cpu_seconds(cfg, facts, work)        # each stage's own estimate (its plan hook)

A CPU run's stage times are its matrix products: the target's forward pass (extraction), the
draft's forward and backward and Muon's Newton-Schulz products (training), the target decoding
(evaluation). How fast this CPU multiplies in the run's format (runner/core/number_format.py)
differs 100-fold between CPU classes, so the plan measures it instead of assuming it: three
products at the run's own shapes, on the threads torch will use, each timed for a quarter of a
second. Each stage turns them into seconds with its efficiency against the probe, measured on
the default pipeline and kept in each stage's rates.yaml (`cpu_rate`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Each product is timed for this long (after one untimed call).
PROBE_S = 0.25
# Tokens of the probe's activations: a batch of training's rows, extraction's batches.
PROBE_TOKENS = 512


@dataclass(frozen=True)
class MachineSpeed:
    """GFLOP/s of this CPU in `dtype` on `threads` threads at the run's shapes."""

    dtype: str
    threads: int
    cpu: str
    # (tokens x hidden) @ (hidden x ffn): the target's and the draft's layers.
    target_gflops: float
    # (tokens x hidden) @ (hidden x draft vocab): the draft's LM head.
    draft_gflops: float
    # (hidden x 3 hidden) @ its transpose: Muon's Newton-Schulz products.
    gram_gflops: float
    probe_s: float

    def line(self) -> str:
        return (
            f"{self.cpu}, {self.threads} thread(s), {self.dtype}: {self.target_gflops:,.0f} "
            f"GFLOP/s at the target's layer, {self.draft_gflops:,.0f} at the draft's head, "
            f"{self.gram_gflops:,.0f} at Muon's products (probe {self.probe_s:.1f} s)"
        )


@dataclass(frozen=True)
class TargetShape:
    """The target's sizes that its own and its draft's arithmetic follow (config.json)."""

    hidden: int
    ffn: int
    # Width of the keys (and of the values): kv heads x head size.
    kv: int
    layers: int
    vocab: int
    # Parameters a token's forward pass multiplies by, without the LM head (extraction's).
    forward_params: float

    @classmethod
    def of(cls, config: dict[str, Any], weight_bytes: float) -> TargetShape:
        text = config.get("text_config") or config
        hidden = int(text.get("hidden_size") or 0)
        heads = int(text.get("num_attention_heads") or 1)
        kv_heads = int(text.get("num_key_value_heads") or heads)
        vocab = int(text.get("vocab_size") or 0)
        tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        params = weight_bytes / 2  # bf16 checkpoint bytes
        return cls(
            hidden=hidden,
            ffn=int(text.get("intermediate_size") or 4 * hidden),
            kv=kv_heads * int(text.get("head_dim") or hidden // heads),
            layers=int(text.get("num_hidden_layers") or 0),
            vocab=vocab,
            forward_params=max(params - (1 if tied else 2) * vocab * hidden, params / 2),
        )


@dataclass(frozen=True)
class Workload:
    """What a CPU run's stages will compute: the conversations prepare keeps, their tokens (an
    estimate from the rows) and training's epochs, on a target of `shape`."""

    speed: MachineSpeed
    rows: int
    tokens: int
    epochs: int
    shape: TargetShape


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "this CPU"


def _gflops(a: Any, b: Any) -> float:
    a @ b  # the first call allocates and picks kernels
    start, calls = time.perf_counter(), 0
    while True:
        a @ b
        calls += 1
        took = time.perf_counter() - start
        if took >= PROBE_S:
            return 2 * a.shape[0] * a.shape[1] * b.shape[1] * calls / took / 1e9


@functools.cache
def probe(dtype: str, threads: int | None, hidden: int, ffn: int, draft_vocab: int) -> MachineSpeed:
    """Measure (once per process and shape) this CPU's rate in `dtype` on `threads` (None:
    torch's own count, what the stages use)."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(0)
        kind = getattr(torch, dtype)

        def rand(*shape: int) -> Any:
            return torch.randn(*shape, generator=g).to(kind)

        x = rand(PROBE_TOKENS, hidden)
        target = _gflops(x, rand(hidden, ffn))
        head = _gflops(x, rand(hidden, draft_vocab))
        w = rand(hidden, 3 * hidden)
        gram = _gflops(w, w.T.contiguous())
        return MachineSpeed(
            dtype=dtype,
            threads=torch.get_num_threads(),
            cpu=cpu_name(),
            target_gflops=target,
            draft_gflops=head,
            gram_gflops=gram,
            probe_s=time.perf_counter() - t0,
        )
    finally:
        torch.set_num_threads(before)


def cpu_table() -> dict[str, Any]:
    """rates.yaml's `cpu` section."""
    from runner.engine.costs import table

    return dict(table().get("cpu") or {})


def cpu_rate(stage: str) -> dict[str, Any]:
    """The stage's row of rates.yaml's `cpu` section: its efficiencies against the probe and
    fixed seconds, with where they were measured."""
    return dict(cpu_table().get(stage) or {})


def fmt_minutes(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min"
