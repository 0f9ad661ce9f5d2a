"""The train stage's settings (`train.*`): the draft's shape, the optimisation, ranks and
checkpoints; their checks, their rules against other sections, and the policy other code asks for
(how many ranks train)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from omegaconf import MISSING

from runner.core.errors import ConfigError
from runner.core.ranges import at_least, seed_range, within

if TYPE_CHECKING:
    from runner.core.schema import RunnerConfig


# speculators' own choices (speculators/train/config/schema.py, 0.9): checked again against the
# installed speculators in the plan (stages/train/).
class Optimizer(StrEnum):
    adamw = "adamw"
    muon = "muon"


class Scheduler(StrEnum):
    linear = "linear"
    cosine = "cosine"
    none = "none"


class LossImplementation(StrEnum):
    eager = "eager"
    fused = "fused"


class DraftAttention(StrEnum):
    sdpa = "sdpa"
    eager = "eager"
    simple_flex_attention = "simple_flex_attention"


@dataclass
class TrainConfig:
    name: str = MISSING
    # Deprecated: the draft vocabulary is the vocab stage's, `vocab.draft_vocab_size`. Still
    # read (with a warning) so that old command lines and sweep files keep working.
    draft_vocab_size: int | None = None
    num_layers: int = 1
    ttt_steps: int = 3
    epochs: int = 1
    # Stop after this many optimizer steps (null = all epochs).
    max_steps: int | None = None
    lr: float = 1e-3
    optimizer: Optimizer = Optimizer.adamw
    scheduler: Scheduler = Scheduler.linear
    warmup_ratio: float = 0.05
    # Tokens per packed training batch; null = data.max_seq_len (one full row per batch).
    # On CPU, attention cost grows with it: short packs train fastest.
    total_seq_len: int | None = None
    val_ratio: float = 0.05
    # A speculators loss name (kl_div, rkl, jsd, ce, tv, nla, lk_hybrid) or a JSON weighting;
    # checked by speculators itself in the plan.
    loss_fn: str = "kl_div"
    # eager runs anywhere; fused needs Triton on a GPU.
    loss_implementation: LossImplementation = LossImplementation.eager
    # sdpa runs anywhere; simple_flex_attention is speculators' GPU default.
    draft_attn_impl: DraftAttention = DraftAttention.sdpa
    num_workers: int = 0
    log_freq: int = 1
    seed: int = 0
    # GPUs training uses, one torchrun rank each; null = every GPU of `hardware`. One GPU (or
    # a CPU) trains in the runner's own process.
    num_gpus: int | None = None
    # Shard parameters, gradients and optimizer states across the GPUs (FSDP2) instead of
    # replicating them (DDP): for drafts whose training state does not fit one GPU.
    fsdp: bool = False
    # Ranks on a machine without GPUs (torch.distributed over gloo): exercises the multi-rank
    # path on CPU (tests, CI); 1 = in the runner's process.
    cpu_processes: int = 1
    # A resumable checkpoint every this fraction of an epoch (0.25 = four per epoch; whole
    # numbers = every N epochs); null = at the end of each epoch. Interrupted training resumes
    # from the latest one.
    checkpoint_every: float | None = None
    # Seconds the trainer gets, after SIGTERM / SIGUSR1 / Ctrl-C, to reach a step boundary and
    # save its checkpoint before it is killed.
    stop_timeout_s: int = 600
    # Print speculators' per-step metric records on the console too (they always go to MLflow
    # and to the work folder's metrics.jsonl; the console gets a progress line every 30 s).
    echo_steps: bool = False
    # Publish every epoch's draft beside the final one (<train artifact>/epochs/<n>), to measure
    # served acceptance against tokens trained and keep the best epoch (EAGLE-3 can degrade with
    # more epochs). One draft's size per epoch.
    keep_epoch_drafts: bool = False
    # The draft layers' attention, as speculators builds it and vLLM serves it: each layer sees
    # the last `sliding_window` tokens (speculators' default, 2048), except the draft layers
    # (0-based) in full_attention_layers, which see the whole context. Equal for contexts within
    # the window; beyond it speculators measured full attention ahead at 2k-8k tokens and the
    # window ahead at 20k (its PR #684).
    sliding_window: int = 2048
    full_attention_layers: list[int] = field(default_factory=list)
    # Any further speculators train flag, e.g. {norm_before_fc: true}.
    extra_args: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        for key in ("num_layers", "ttt_steps", "epochs", "log_freq", "sliding_window"):
            at_least(f"train.{key}", getattr(self, key), 1)
        full = list(self.full_attention_layers)
        bad = [i for i in full if not 0 <= i < self.num_layers]
        if bad or len(set(full)) != len(full):
            raise ConfigError(
                "train.full_attention_layers",
                f"{full}: each must be a draft layer index in [0, {self.num_layers}) "
                f"(train.num_layers={self.num_layers}), each once",
            )
        if self.max_steps is not None:
            at_least("train.max_steps", self.max_steps, 1)
        if self.total_seq_len is not None:
            at_least("train.total_seq_len", self.total_seq_len, 16)
        within("train.warmup_ratio", self.warmup_ratio, 0.0, 1.0)
        seed_range("train.seed", self.seed)
        at_least("train.num_workers", self.num_workers, 0)
        at_least("train.cpu_processes", self.cpu_processes, 1)
        at_least("train.stop_timeout_s", self.stop_timeout_s, 1)
        if self.num_gpus is not None:
            at_least("train.num_gpus", self.num_gpus, 1)
        c = self.checkpoint_every
        if c is not None and (c <= 0 or (c > 1 and not float(c).is_integer())):
            raise ConfigError(
                "train.checkpoint_every",
                f"{c} must be a fraction of an epoch (0 < x <= 1) or a whole number of epochs",
            )
        if not 0 < self.val_ratio < 1:
            raise ConfigError("train.val_ratio", f"{self.val_ratio} must be in (0, 1)")
        if self.lr <= 0:
            raise ConfigError("train.lr", f"{self.lr} must be > 0")

    def resolve(self, cfg: RunnerConfig) -> None:
        """train.draft_vocab_size -> vocab.draft_vocab_size (the vocab stage owns it)."""
        old = self.draft_vocab_size
        if old is None:
            return
        vocab = getattr(cfg, "vocab", None)
        if vocab is None:
            raise ConfigError("train.draft_vocab_size", "is deprecated; set vocab.draft_vocab_size")
        logging.getLogger("runner").warning(
            "train.draft_vocab_size is deprecated; use vocab.draft_vocab_size (taking %d)", old
        )
        vocab.draft_vocab_size = old
        self.draft_vocab_size = None

    def check_across(self, cfg: RunnerConfig) -> None:
        """The rows against a batch, the kernels and ranks against the device."""
        d, hw = cfg.data, cfg.hardware
        if self.total_seq_len is not None and self.total_seq_len < d.max_seq_len:
            raise ConfigError(
                "train.total_seq_len",
                f"{self.total_seq_len} is below data.max_seq_len={d.max_seq_len}; "
                "a sample would not fit a batch",
            )
        if hw.device == "cpu" and self.loss_implementation == "fused":
            raise ConfigError(
                "train.loss_implementation", "'fused' is a Triton GPU kernel; use 'eager' on CPU"
            )
        if hw.device == "cpu" and self.draft_attn_impl == "simple_flex_attention":
            raise ConfigError(
                "train.draft_attn_impl", "flex attention needs a GPU; use 'sdpa' on CPU"
            )
        if hw.device == "cpu" and self.num_gpus:
            raise ConfigError(
                "train.num_gpus",
                f"{self.num_gpus} GPUs on hardware '{hw.name}' (device cpu); use null, or "
                "train.cpu_processes for several CPU ranks",
            )
        if hw.device == "cuda" and self.num_gpus is not None and self.num_gpus > hw.num_gpus:
            raise ConfigError(
                "train.num_gpus",
                f"{self.num_gpus} exceeds the {hw.num_gpus} GPU(s) of hardware '{hw.name}' "
                "(hardware.num_gpus)",
            )
        if hw.device == "cuda" and self.cpu_processes != 1:
            raise ConfigError(
                "train.cpu_processes", "is for machines without GPUs; use train.num_gpus"
            )
        if self.fsdp and train_ranks(cfg) < 2:
            raise ConfigError(
                "train.fsdp",
                f"shards across ranks, but training has {train_ranks(cfg)} "
                "(train.num_gpus / hardware.num_gpus); use it with 2 or more GPUs",
            )


def train_ranks(cfg: RunnerConfig) -> int:
    """How many processes train: GPUs on a GPU machine, `cpu_processes` without one."""
    t, hw = cfg.train, cfg.hardware
    if hw.device == "cpu":
        return t.cpu_processes
    n = t.num_gpus if t.num_gpus is not None else hw.num_gpus
    if t.num_gpus is None and serves_while_training(cfg) and cfg.extract.share_gpu is None:
        # The server the train stage starts takes tensor_parallel_size GPUs of the box.
        n = hw.num_gpus - hw.tensor_parallel_size
    return max(n, 1)


def serves_while_training(cfg: RunnerConfig) -> bool:
    """Online training with a server the train stage starts on this machine (extract.mode
    online, no hardware.vllm.endpoint)."""
    return cfg.extract.mode == "online" and not cfg.hardware.vllm.endpoint
