"""What training a draft will take, from config files alone: parameters, and peak memory per
GPU by part. Pure functions of the config and the target's shape (no torch), used by the train
stage's plan and checked against measured peaks (docs/benchmarks.md).

    memory_estimate(cfg, target)["total"]    # bytes per GPU
"""

from __future__ import annotations

from runner.assets.target_facts import Target
from runner.core.schema import RunnerConfig
from runner.engine.stage import Plan


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
    h, vd, ranks = layout.hidden_size, cfg.vocab.draft_vocab_size, cfg.train_ranks()
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
