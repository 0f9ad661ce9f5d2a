"""Every check of a run's config, in one pass and one place each.

`check_config(cfg, stage_names)` runs the checks that need nothing but the config (each beside
its field: runner/core/schema.py for the run-wide sections, stages/<stage>/settings.py for a
stage's own). `check_target(cfg, target, stages)` runs the ones that need the
target's facts, read from its config files in seconds (runner/assets/target_facts.py): the target's
own (layers, heads, TP, weights per GPU), then each stage's `Stage.check_target` for its own
settings. Both raise `ConfigError` naming the key to change. What depends on this machine
(free disk, the installed vLLM) is checked while the plan is built (runner/engine/preflight.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from runner.assets.target_facts import Target, weight_bytes
from runner.assets.weights import check_shapes, check_weights
from runner.core.errors import ConfigError
from runner.core.layer_ids import CAPTURE_PRESETS
from runner.core.schema import RunnerConfig
from runner.engine.stage import Stage

GiB = 1 << 30
# Above this share of a GPU the weights leave no room for activations and KV cache.
WEIGHTS_MAX_GPU_SHARE = 0.95


def check_config(cfg: RunnerConfig, stage_names: tuple[str, ...]) -> None:
    cfg.check(stage_names)


def check_aux_layers(layers: list[int] | tuple[int, ...], n: int, key: str) -> None:
    if not layers:
        raise ConfigError(key, "needs at least one auxiliary layer id")
    if len(set(layers)) != len(layers):
        raise ConfigError(
            key,
            f"{list(layers)} has duplicates; vLLM de-duplicates ids and the draft's input width "
            "would no longer match",
        )
    for lid in layers:
        if not 0 <= lid < n:
            hint = (
                " (the final layer n is appended automatically; list auxiliary layers only)"
                if lid == n
                else ""
            )
            raise ConfigError(
                key, f"layer id {lid} is outside 0..{n - 1} for a {n}-layer target{hint}"
            )
    if list(layers) != sorted(layers):
        raise ConfigError(
            key,
            f"{list(layers)} must be ascending (vLLM sorts them; the draft would see its inputs "
            "in another order)",
        )


def _check_preset(name: str, n: int, key: str) -> None:
    """A named preset on a target too shallow for it gives repeated or unordered ids (default
    on 3 layers: [2, 1, 0]); say so, and from how many layers it works."""
    ids = CAPTURE_PRESETS[name](n)
    try:
        check_aux_layers(ids, n, key)
    except ConfigError:
        works = next((k for k in range(n + 1, 200) if _valid(CAPTURE_PRESETS[name](k), k)), None)
        raise ConfigError(
            key,
            f"preset {name!r} gives {ids} on this {n}-layer target: not distinct ascending ids "
            f"in 0..{n - 1} (it needs >= {works} layers). List the ids in model.capture_layers, "
            f"e.g. {_spread(n)}",
        ) from None


def _valid(ids: list[int], n: int) -> bool:
    return ids == sorted(set(ids)) and all(0 <= i < n for i in ids)


def _spread(n: int) -> list[int]:
    """Up to three distinct ascending ids for a shallow target (a suggestion only)."""
    return sorted({max(0, min(n - 1, i)) for i in (1, n // 2, n - 1)}) if n > 1 else [0]


def check_preset(name: str, n: int, key: str) -> None:
    """A capture preset must give distinct ascending ids on this target (stages check theirs)."""
    _check_preset(name, n, key)


def check_target(cfg: RunnerConfig, target: Target, stages: tuple[Stage, ...] = ()) -> None:
    _check_target(cfg, target)
    for stage in stages:
        if stage.check_target is not None and stage.is_on(cfg):
            stage.check_target(cfg, target)


def check_generation_config(folder: Path) -> None:
    """generation_config.json, where the folder has one, is JSON (vLLM and transformers read
    it at load, after the weights: a garbage file fails there, half an hour in on a large
    target)."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return
    try:
        found = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError("model.source", f"{path} is not JSON ({exc}): fix or remove it") from None
    if not isinstance(found, dict):
        raise ConfigError("model.source", f"{path} is not a JSON object: fix or remove it")


def _check_target(cfg: RunnerConfig, target: Target) -> None:
    m, facts, layout = cfg.model, target.facts, target.layout
    folder = Path(facts.path)
    if folder.is_dir():  # a local folder (a packaged GGUF's once converted): its weights' headers
        check_weights(
            folder,
            layout.layers,
            layout.embed,
            {
                "num_layers": layout.num_layers,
                "hidden_size": layout.hidden_size,
                "vocab_size": layout.vocab_size,
            },
        )
        check_shapes(folder, target.config)
        check_generation_config(folder)
    reasons = target.remote_code_reasons
    if reasons and not m.trust_remote_code:
        raise ConfigError(
            "model.trust_remote_code",
            f"{'; '.join(reasons)}. Set model.trust_remote_code=true if you trust {m.source}",
        )
    if m.trust_remote_code and not reasons:
        raise ConfigError(
            "model.trust_remote_code",
            f"is true but {m.source} needs no custom code (transformers ships its classes and "
            "its tokenizer); set it false so that no downloaded code runs",
        )
    arch = (target.config.get("architectures") or [None])[0]
    if m.architecture and arch and m.architecture != arch:
        raise ConfigError(
            "model.architecture", f"expects {m.architecture} but config.json says {arch}"
        )
    for name in ("num_layers", "hidden_size", "vocab_size"):
        declared, actual = getattr(m, name), getattr(layout, name)
        if declared is not None and declared != actual:
            raise ConfigError(
                f"model.{name}", f"declares {declared} but the target's config.json says {actual}"
            )
    n = facts.num_layers
    if m.capture_layers is None:
        _check_preset(m.capture_preset, n, "model.capture_preset")
    check_aux_layers(facts.aux_layers, n, "model.capture_layers")
    tp = cfg.hardware.tensor_parallel_size
    heads, kv = layout.num_attention_heads, layout.num_key_value_heads
    if heads % tp:
        raise ConfigError(
            "hardware.tensor_parallel_size",
            f"TP {tp} does not divide the target's {heads} attention heads",
        )
    if kv % tp and tp % kv:
        raise ConfigError(
            "hardware.tensor_parallel_size",
            f"TP {tp} and the target's {kv} KV heads do not divide one another",
        )
    gpu_gib = cfg.hardware.gpu_memory_gib
    w = weight_bytes(layout, target.config, m.weights_gib)
    per_gpu = w.bytes / tp
    # An estimate marked uncertain is stated in the plan, never refused on.
    if w.certain and gpu_gib and per_gpu > WEIGHTS_MAX_GPU_SHARE * gpu_gib * GiB:
        raise ConfigError(
            "hardware.tensor_parallel_size",
            f"~{per_gpu / GiB:.1f} GiB of weights per GPU do not fit {gpu_gib:g} GiB; "
            "raise TP / GPUs",
        )
