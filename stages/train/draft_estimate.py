"""What training a draft will take, from config files alone: parameters, and peak memory per
GPU by part. Pure functions of the config and the target's shape (no torch), used by the train
stage's plan and checked against measured peaks (docs/benchmarks.md).

    memory_estimate(cfg, target)["total"]    # bytes per GPU
"""

from __future__ import annotations

import math
from typing import Any

from runner.assets.target_facts import Target
from runner.core.schema import RunnerConfig
from runner.engine.stage import Plan
from stages.train.settings import train_ranks


def _intermediate(target: Target) -> int:
    text = target.config.get("text_config") or target.config
    return int(text.get("intermediate_size") or 4 * target.layout.hidden_size)


def trainable_params(cfg: RunnerConfig, target: Target) -> int:
    """What speculators trains: fc from the aux layers and the decoder layers (q/k/v read the
    token embedding and the fused hidden state side by side: 2h inputs)."""
    layout, t = target.layout, cfg.train
    h = layout.hidden_size
    heads, kv = layout.num_attention_heads, layout.num_key_value_heads
    head_dim = h // heads
    attn = 2 * h * (heads + 2 * kv) * head_dim + h * h
    aux = len(target.facts.aux_layers)
    return aux * h * h + t.num_layers * (attn + 3 * h * _intermediate(target))


def draft_params(cfg: RunnerConfig, target: Target) -> int:
    """Parameters of the draft checkpoint: the trained ones plus its LM head over the draft
    vocab (copied from the target's, frozen)."""
    return trainable_params(cfg, target) + target.layout.hidden_size * cfg.vocab.draft_vocab_size


# Bytes per trained parameter beyond the fp32 weight and gradient: optimizer states.
_OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "muon": 4, "sgd": 4}
# CUDA context, allocator fragmentation and workspace per GPU, measured on an H200.
_OVERHEAD_BYTES = 1.5 * 2**30


def memory_estimate(cfg: RunnerConfig, target: Target) -> dict[str, float]:
    """Peak training memory per GPU in bytes, by part (and "total"):
    - state: trained parameters, gradients and optimizer states in fp32 (sharded under FSDP);
    - frozen: the target's token embedding and the draft's LM head that speculators loads,
      in fp32 (sharded under FSDP);
    - logits: draft and teacher logits over the draft vocab in fp32 for every TTT step, with
      their gradient (eager loss keeps a softmax copy more);
    - activations: what each decoder layer keeps for backward in bf16, every TTT step;
    - inputs: one packed batch of captured hidden states in bf16;
    - buckets: DDP's gradient buckets, a second fp32 copy of the gradients (several ranks);
    - overhead: CUDA context and allocator slack.
    Measured on H200 at the Kimi-K2.5 shape (docs/benchmarks.md): 1 GPU 35.7 GiB allocated at
    peak against 32.0 estimated, 2 GPUs (DDP) 41.4 against 35.4."""
    t, layout = cfg.train, target.layout
    h, vd, ranks = layout.hidden_size, cfg.vocab.draft_vocab_size, train_ranks(cfg)
    seq = t.total_seq_len or cfg.data.max_seq_len
    shard = ranks if t.fsdp else 1
    trained = trainable_params(cfg, target)
    parts = {
        "state": trained * (8 + _OPTIMIZER_BYTES.get(t.optimizer, 8)) / shard,
        "frozen": (layout.vocab_size + vd) * h * 4 / shard,
        "logits": t.ttt_steps * seq * vd * 4 * (3 if t.loss_implementation == "fused" else 4),
        "activations": t.ttt_steps * t.num_layers * seq * (10 * h + 3 * _intermediate(target)) * 2,
        "inputs": seq * (len(target.facts.extract_ids) + 1) * h * 2,
        "buckets": trained * 4 if ranks > 1 and not t.fsdp else 0,
        "overhead": _OVERHEAD_BYTES,
    }
    parts["total"] = sum(parts.values())
    return parts


def plan_memory(p: Plan, cfg: RunnerConfig, target: Target) -> None:
    """The plan's line for training memory per GPU, and a refusal naming the key that helps
    when it does not fit the hardware's GPUs."""
    hw, t = cfg.hardware, cfg.train
    mem = memory_estimate(cfg, target)
    p.numbers["train_memory_bytes"] = mem["total"]
    gib = 2**30
    of_gpu = f" of {hw.gpu_memory_gib:g} GiB" if hw.gpu_memory_gib else ""
    p.add(
        "training memory",
        f"~{mem['total'] / gib:.1f} GiB per GPU{of_gpu}: "
        + ", ".join(f"{k} {v / gib:.1f}" for k, v in mem.items() if k != "total"),
    )
    if hw.gpu_memory_gib and mem["total"] > 0.95 * hw.gpu_memory_gib * gib:
        if mem["logits"] + mem["activations"] >= mem["state"] + mem["frozen"]:
            key, fix = "train.total_seq_len", "lower it: logits and activations grow with it"
        elif not t.fsdp:
            key, fix = "train.fsdp", "set it true to shard the training state across GPUs"
        else:
            key, fix = "train.num_gpus", "raise it to shard the training state further"
        p.error(
            key,
            f"training needs ~{mem['total'] / gib:.1f} GiB per GPU, more than the "
            f"{hw.gpu_memory_gib:g} GiB of hardware '{hw.name}'; {fix}",
        )


def _muon_matrices(cfg: RunnerConfig, shape: Any) -> list[tuple[int, int]]:
    """The 2-D weights Muon orthogonalises (speculators routes the embedding and LM head to
    AdamW): fc from the three aux layers, and each decoder layer's projections."""
    h, kv, ffn = shape.hidden, shape.kv, shape.ffn
    layer = [(h, 2 * h), (kv, 2 * h), (kv, 2 * h), (h, h), (ffn, h), (ffn, h), (h, ffn)]
    return [(h, 3 * h), *layer * cfg.train.num_layers]


def muon_flops(cfg: RunnerConfig, shape: Any) -> float:
    """Floating-point operations of one optimizer step's Newton-Schulz products: per matrix
    (m <= n) and iteration, X X^T (2 m^2 n), the Gram's square (2 m^3) and the product with X
    (2 m^2 n). About 67 GFLOP for the default's draft at 5 iterations."""
    if cfg.train.optimizer != "muon":
        return 0.0
    steps = int(cfg.train.extra_args.get("muon_ns_steps", 5))
    total = 0.0
    for a, b in _muon_matrices(cfg, shape):
        m, n = min(a, b), max(a, b)
        total += steps * (4 * m * m * n + 2 * m**3)
    return total


def draft_flops_per_token(cfg: RunnerConfig, shape: Any) -> float:
    """Forward floating-point operations per token: fc, then every TTT step's decoder layers
    (q/k/v read 2h inputs) and LM head over the draft vocab."""
    h, kv, ffn, t = shape.hidden, shape.kv, shape.ffn, cfg.train
    layer = 2 * h * (h + 2 * kv) + h * h + 3 * h * ffn
    step = t.num_layers * layer + h * cfg.vocab.draft_vocab_size
    return 2.0 * (3 * h * h + t.ttt_steps * step)


def cpu_seconds(cfg: RunnerConfig, work: Any) -> float:
    """Training on this CPU: each step's forward and backward (three times the forward's
    products) over a pack of rows, Muon's products once a step, and the validation passes."""
    from runner.engine.cpu_speed import cpu_rate

    r, t = cpu_rate("train"), cfg.train
    per_row = work.tokens / max(1, work.rows)
    seq = t.total_seq_len or cfg.data.max_seq_len
    rows_per_step = max(1, int(seq // max(1.0, per_row)))
    train_rows = work.rows * (1 - t.val_ratio)
    steps = math.ceil(train_rows / rows_per_step) * work.epochs
    if t.max_steps is not None:
        steps = min(steps, t.max_steps)
    fwd = draft_flops_per_token(cfg, work.shape)
    dense = work.speed.draft_gflops * 1e9 * float(r.get("efficiency", 0.7))
    gram = work.speed.gram_gflops * 1e9 * float(r.get("muon_efficiency", 1.0))
    step_s = 3 * fwd * per_row * rows_per_step / dense + muon_flops(cfg, work.shape) / gram
    val_s = work.rows * t.val_ratio * work.epochs * per_row * fwd / dense
    return float(r.get("fixed_s", 0.0)) + steps * step_s + val_s
