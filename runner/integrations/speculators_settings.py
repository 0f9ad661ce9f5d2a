"""The runner's config as speculators' train settings, and speculators' refusals as runner keys.

    settings = speculators_settings(cfg, facts, data, states, vocab, save)   # {field: value}
    resolve_train_config(settings)          # runner.integrations.speculators: from_sources
    setting_key(cfg, refused.dest)          # -> "train.lr", "train.extra_args.foo", ...

The settings are the fields `speculators train` sets from its flags (`--lr` -> "lr"), passed to
its pure `TrainConfig.from_sources`; `train.extra_args` entries are fields too, and win. The
plan resolves them once with placeholder paths, so a value speculators refuses stops the run
before anything loads, naming the runner key it came from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runner.assets.target_facts import ModelFacts
from runner.core.schema import RunnerConfig
from runner.integrations import SLOT_BACKEND

# The runner key each speculators setting comes from, so that speculators' own refusal of a
# value (checked in the plan) names the key to change; `train.extra_args` entries name theirs.
SETTING_KEYS = {
    "draft_vocab_size": "vocab.draft_vocab_size",
    "target_layer_ids": "model.capture_layers",
    "num_layers": "train.num_layers",
    "ttt_steps": "train.ttt_steps",
    "epochs": "train.epochs",
    "lr": "train.lr",
    "optimizer": "train.optimizer",
    "scheduler_type": "train.scheduler",
    "scheduler_warmup_ratio": "train.warmup_ratio",
    "total_seq_len": "train.total_seq_len",
    "train_data_ratio": "train.val_ratio",
    "loss_fn": "train.loss_fn",
    "loss_implementation": "train.loss_implementation",
    "draft_attn_impl": "train.draft_attn_impl",
    "sliding_window": "train.sliding_window",
    "full_attention_indices": "train.full_attention_layers",
    "num_workers": "train.num_workers",
    "log_freq": "train.log_freq",
    "seed": "train.seed",
    "hidden_states_dtype": "hardware.dtype",
    "checkpoint_freq": "train.checkpoint_every",
    "fsdp_shard": "train.fsdp",
    "max_steps": "train.max_steps",
    "trust_remote_code": "model.trust_remote_code",
    "vllm_endpoint": "hardware.vllm.endpoint",
    "request_timeout": "extract.request_timeout_s",
    "max_retries": "extract.max_retries",
}


def setting_key(cfg: RunnerConfig, dest: str | None) -> str:
    if dest in cfg.train.extra_args:
        return f"train.extra_args.{dest}"
    return SETTING_KEYS.get(dest or "", "train.extra_args")


def speculators_settings(
    cfg: RunnerConfig,
    facts: ModelFacts,
    data_path: Path,
    hidden_states: Path,
    vocab: Path,
    save_path: Path,
    online: str | None = None,
) -> dict[str, Any]:
    """speculators' train settings for this config ({field: value}: what `speculators train`
    sets from its flags; recorded in the manifest). online: the URL of the vLLM server (…/v1)
    that speculators fetches every sample from (extract.mode=online); `hidden_states` is then an
    empty folder, so nothing is read from disk. `train.extra_args` come last and win."""
    t = cfg.train
    s: dict[str, Any] = {
        "speculator_type": "eagle3",
        "verifier_name_or_path": facts.path,
        "data_path": str(data_path),
        "hidden_states_path": str(hidden_states),
        "d2t_path": str(vocab / "d2t.npy"),
        "t2d_path": str(vocab / "t2d.npy"),
        "draft_vocab_size": cfg.vocab.draft_vocab_size,
        "target_layer_ids": list(facts.aux_layers),
        "num_layers": t.num_layers,
        "ttt_steps": t.ttt_steps,
        "epochs": t.epochs,
        "lr": t.lr,
        "optimizer": str(t.optimizer),
        "scheduler_type": str(t.scheduler),
        "scheduler_warmup_ratio": t.warmup_ratio,
        "total_seq_len": t.total_seq_len or cfg.data.max_seq_len,
        "train_data_ratio": 1.0 - t.val_ratio,
        "loss_fn": t.loss_fn,
        "loss_implementation": str(t.loss_implementation),
        "draft_attn_impl": str(t.draft_attn_impl),
        "sliding_window": t.sliding_window,
        "full_attention_indices": [int(i) for i in t.full_attention_layers],
        "num_workers": t.num_workers,
        "log_freq": t.log_freq,
        "seed": t.seed,
        "hidden_states_dtype": str(cfg.hardware.dtype),
        "on_missing": "raise" if online is None else "generate",
        "save_path": str(save_path),
        "log_dir": str(save_path.parent / "logs"),
    }
    if online is not None:
        s.update(
            vllm_endpoint=online,
            request_timeout=cfg.extract.request_timeout_s,
            max_retries=cfg.extract.max_retries,
        )
    if t.checkpoint_every is not None:
        s["checkpoint_freq"] = t.checkpoint_every
    if t.fsdp:
        s["fsdp_shard"] = True
    if t.max_steps is not None:
        s["max_steps"] = t.max_steps
    if facts.train_slots != tuple(range(len(facts.extract_ids))):
        # The files hold a sweep's superset of layers; read only this job's slots (fp8 files are
        # dequantized by the same reader).
        s["hidden_states_backend"] = SLOT_BACKEND
    elif cfg.extract.storage == "fp8" and online is None:
        # speculators' own fp8 reader (hs-connectors' FP8Transfer): no conversion step.
        s["hidden_states_backend"] = "fp8"
    if cfg.model.trust_remote_code:
        s["trust_remote_code"] = True
    return {**s, **t.extra_args}
