"""Typed schema of the composed run config, and the checks that need nothing but the config.

Hydra composes `conf/config.yaml` with one option per group; `runner.__main__` registers
`RunnerConfig` as the base of that composition, so OmegaConf rejects unknown keys and wrong
types at composition time with the offending key in the message
(e.g. "Key 'foo' not in 'TrainConfig' ... full_key: train.foo"). `typed(cfg)` then converts the
composed config once into these dataclasses; stages and checks receive them, never raw nodes.

Here are the run-wide sections (model, tracking, run; hardware in
runner/core/hardware_settings.py) and the schema's assembly; each stage's own section (data for
prepare, extract, train, vocab, eval, regenerate) is in its package (stages/<stage>/settings.py)
and joins the schema through the registry (`schema_for`). The range checks they share are
runner/core/ranges.py. Each section's `check()` holds the checks of its own fields, beside them;
a section's `check_across(cfg)` holds its rules against other sections. Checks that need the
target's facts (layer counts, vocab size, heads) live in `runner.engine.checks`, which runs them
once those facts are read from config files.

Layer ids everywhere in configs use the vLLM / speculators convention: id k is the residual
stream entering decoder layer k (the output of layer k-1), 0 is the embedding output, and
n (= num_layers) is the last layer's output *before* the final norm. `capture_layers` lists the
auxiliary layers only; the runner always appends n.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from runner.core.errors import ConfigError
from runner.core.hardware_settings import Dtype, HardwareConfig
from runner.core.layer_ids import CAPTURE_PRESETS
from runner.core.number_format import choose_dtype
from runner.core.ranges import above, at_least, finite, path_component
from runner.core.serving_flags import fold


# Closed choices are enums: OmegaConf refuses any other value while Hydra composes the config,
# naming the key and listing the choices. StrEnum members compare, print and serialise as their
# plain string values, so the rest of the code (and every stage key) sees strings.
class Verify(StrEnum):
    # Sizes, and a hash of every file modified since it was published.
    cheap = "cheap"
    # A hash of every file.
    full = "full"


class OnDamaged(StrEnum):
    # Move the damaged artifact aside and compute it again.
    recompute = "recompute"
    # Stop the run, naming the damaged file.
    stop = "stop"


# `run.stages` / `run.force` value that means every registered stage.
ALL_STAGES = "all"


@dataclass
class ModelConfig:
    # Short name used in run names and the store.
    name: str = MISSING
    # Where the weights come from: a local folder, a Hugging Face id, or
    # "package:<module>" for a GGUF file shipped inside an installed Python package.
    source: str = MISSING
    # GGUF file inside a "package:" source; converted once to a plain HF folder.
    gguf_file: str | None = None
    # The target's Hugging Face id, recorded in the draft's config as its verifier so that the
    # draft loads and serves on another machine (the local path stays in the runner's section).
    # null: the source itself when it is a hub id, else the local path.
    hub_id: str | None = None
    # The target's license, for a published draft's card (the hub's names: apache-2.0, mit,
    # other, ...). null = what the target says: its folder's README front matter, or its GGUF
    # metadata (general.license).
    license: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    # Auxiliary capture layers (vLLM convention, final layer excluded). null = the preset below.
    capture_layers: list[int] | None = None
    # Named choice derived from the layer count n, so one sweep file fits every target:
    # default [2, n//2, n-3] (speculators'/vLLM's), early [1, n//4, n//2], late [n//2, 3n//4, n-2],
    # four [2, n//3, 2n//3, n-3].
    capture_preset: str = "default"
    # Facts about the target; checked against its config.json before any weights load.
    num_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    # A Jinja chat template that replaces the tokenizer's own (null = the tokenizer's).
    chat_template: str | None = None
    # Template keyword arguments this target needs (e.g. Kimi's {thinking: false}); data's own
    # chat_template_kwargs are applied on top.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Expected config.json architecture (checked against it), e.g. KimiK25ForConditionalGeneration.
    architecture: str | None = None
    # Where the text model and LM head live, for wrappers neither transformers nor the runner's
    # registry knows: {text_model: language_model.model, lm_head: language_model.lm_head}.
    layout: dict[str, str] = field(default_factory=dict)
    # Checkpoint size in GiB, for the weights-per-GPU estimate, when config.json cannot say
    # (a quantization the plan does not know); null = estimated from config.json.
    weights_gib: float | None = None
    # Longest sequence the target takes; null = its config.json (max_position_embeddings).
    max_context: int | None = None

    def check(self) -> None:
        path_component("model.name", self.name)
        if self.weights_gib is not None:
            finite("model.weights_gib", self.weights_gib)
            above("model.weights_gib", self.weights_gib, 0)
        if self.max_context is not None:
            at_least("model.max_context", self.max_context, 16)
        for key in ("num_layers", "hidden_size", "vocab_size"):
            if getattr(self, key) is not None:
                at_least(f"model.{key}", getattr(self, key), 1)
        if self.capture_layers is not None and not self.capture_layers:
            raise ConfigError("model.capture_layers", "is empty; list auxiliary layer ids or null")
        if self.capture_preset not in CAPTURE_PRESETS:
            raise ConfigError(
                "model.capture_preset",
                f"unknown preset {self.capture_preset!r}; choose from {sorted(CAPTURE_PRESETS)}",
            )


# The longest experiment name every MLflow store keeps: its client checks 500 characters
# (mlflow.utils.validation), its SQL stores' column holds 256 (a database server refuses more).
EXPERIMENT_NAME_MAX = 256


@dataclass
class TrackingConfig:
    # null = MLFLOW_TRACKING_URI if set, else sqlite at <output_root>/mlflow.db.
    uri: str | None = None
    experiment: str = "eagle3"
    # Stage outputs larger than this (the draft checkpoint, in practice) are linked (path
    # recorded as a tag) instead of copied into MLflow.
    log_checkpoint_max_mb: int = 512
    # Seconds to wait for a tracking server (http/https tracking.uri) before the run is refused;
    # checked in the plan, before any stage.
    connect_timeout_s: float = 10.0
    # A run whose draft was served and passed its gates (not a smoke test) registers it as a
    # version of this MLflow registered model, so that MLflow's Models page lists it; null =
    # eagle3-<model.name>. register_draft=false: never.
    register_draft: bool = True
    registered_model: str | None = None

    def check(self) -> None:
        at_least("tracking.log_checkpoint_max_mb", self.log_checkpoint_max_mb, 0)
        above("tracking.connect_timeout_s", self.connect_timeout_s, 0)
        if not self.experiment.strip():
            raise ConfigError("tracking.experiment", "is empty")
        if len(self.experiment) > EXPERIMENT_NAME_MAX:
            raise ConfigError(
                "tracking.experiment",
                f"is {len(self.experiment):,} characters; MLflow takes at most "
                f"{EXPERIMENT_NAME_MAX}",
            )


@dataclass
class RunConfig:
    name: str | None = None
    # Stages this invocation runs (in pipeline order); upstream ones come from the store.
    # [all] = every stage of the registry (stages/__init__.py); with eval.draft, evaluate alone.
    stages: list[str] = field(default_factory=lambda: [ALL_STAGES])
    # Stages recomputed even when the store holds a finished artifact for their key ([all] too).
    force: list[str] = field(default_factory=list)
    # Root of the artifact store, model cache and default MLflow store.
    output_root: str = "outputs"
    # Print the preflight plan and stop: no weights load, no GPU needed, seconds.
    plan_only: bool = False
    # How a stored artifact is checked against its manifest before it is reused (the draft is
    # always hashed in full before it is served).
    verify: Verify = Verify.cheap
    # What a damaged artifact leads to.
    on_damaged: OnDamaged = OnDamaged.recompute
    # A smoke test (preset=quick sets it): the summary and the MLflow run say that its figures
    # show the stages work, not how good a draft is.
    smoke_test: bool = False
    # Minutes the pipeline may take on a CPU (conf/config.yaml: 20): the plan measures this
    # machine's speed and lowers data.num_samples until its estimate fits (runner/engine/
    # budget.py). data.num_samples, train.epochs or train.max_steps given on the command line are
    # kept. null = off; GPU runs are not sized.
    time_budget: float | None = None

    def check(self, known: tuple[str, ...]) -> None:
        for key, names in (("run.stages", self.stages), ("run.force", self.force)):
            unknown = [s for s in names if s not in known and s != ALL_STAGES]
            if unknown:
                raise ConfigError(
                    key, f"unknown stage(s) {unknown}; choose from {list(known)} or {ALL_STAGES}"
                )
        if not self.stages:
            raise ConfigError("run.stages", "is empty; name at least one stage (or all)")
        if self.time_budget is not None:
            above("run.time_budget", self.time_budget, 0)


@dataclass
class RunnerConfig:
    """The run-wide sections. Each stage adds its own section (`Stage.settings`: data, extract,
    train, vocab, eval, regenerate) through the registry's schema (`schema_for`); a section may
    define `resolve(cfg)` (defaults that depend on other sections, called once when the config is
    typed) and `check_across(cfg)` (its rules against other sections), so that a stage's rules
    live beside its settings, not here."""

    model: ModelConfig = field(default_factory=ModelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def sections(self) -> list[Any]:
        """Every section, the stages' own included, in the schema's order."""
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def check(self, stage_names: tuple[str, ...]) -> None:
        """Every check that needs nothing but this config: each section's own (found from the
        dataclass fields, a stage's own settings section included), then each section's rules
        against the others (`check_across`)."""
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if f.name != "run" and callable(getattr(section, "check", None)):
                section.check()
        self.run.check(stage_names)
        for section in self.sections():
            if callable(getattr(section, "check_across", None)):
                section.check_across(self)

    def run_name(self) -> str:
        """run.name, else <model>-<data>-<train> (the options that make the recipe)."""
        recipe = getattr(getattr(self, "train", None), "name", None) or "draft"
        data = getattr(getattr(self, "data", None), "name", None) or "data"
        return self.run.name or f"{self.model.name}-{data}-{recipe}"


def schema_for(stages: Iterable[Any]) -> type[RunnerConfig]:
    """The config schema of a registry: RunnerConfig plus a section for each stage that declares
    its own settings (`Stage.settings`, a dataclass with defaults and a `check()`), under the
    stage's name; e.g. `count.min_rows=5`. A stage with settings is one module and one registry
    line: its section is composed, typed, checked and logged like the built-in ones."""
    extra = tuple(
        (getattr(s, "section", None) or s.name, s.settings)
        for s in stages
        if getattr(s, "settings", None) is not None
        and (getattr(s, "section", None) or s.name)
        not in {f.name for f in dataclasses.fields(RunnerConfig)}
    )
    return _schema(extra)


@functools.cache
def _schema(extra: tuple[tuple[str, type], ...]) -> type[RunnerConfig]:
    if not extra:
        return RunnerConfig
    fields = [(name, kind, field(default_factory=kind)) for name, kind in extra]
    return dataclasses.make_dataclass("RunnerConfig", fields, bases=(RunnerConfig,))


def register(stages: Iterable[Any]) -> type[RunnerConfig]:
    """Make the registry's schema the base of Hydra's composition (`base_config` in
    conf/config.yaml's defaults); returns it. The composition root calls it once."""
    from hydra.core.config_store import ConfigStore

    schema = schema_for(stages)
    ConfigStore.instance().store(name="base_config", node=schema)
    return schema


def schema_of(node: Any) -> type[RunnerConfig]:
    """The schema a composed config was built on: Hydra composes onto the registered base
    (`register`), so the node carries it (the stages' sections included); a node built any other
    way is read against RunnerConfig alone."""
    kind = OmegaConf.get_type(node) if OmegaConf.is_config(node) else None
    return kind if isinstance(kind, type) and issubclass(kind, RunnerConfig) else RunnerConfig


def check_known_keys(node: DictConfig, schema: type[RunnerConfig] | None = None) -> None:
    """Reject keys the schema does not know, including ones added with Hydra's `+key=value`
    (which bypasses the schema's struct mode). Free-form dicts (env, extra args) are exempt."""

    def walk(sub: Any, schema: Any, prefix: str) -> None:
        for key in sub:
            if key == "hydra":
                continue
            full = f"{prefix}{key}"
            if key == "_target_":
                raise ConfigError(full, "the runner instantiates no classes from config; remove it")
            if key not in list(schema.keys()):
                known = sorted(str(k) for k in schema)
                where = prefix.rstrip(".") or "the root"
                near = difflib.get_close_matches(str(key), known, n=1)
                hint = f"did you mean {prefix}{near[0]}? " if near else ""
                raise ConfigError(full, f"unknown key; {hint}{where} takes: {', '.join(known)}")
            child = schema.get(key) if OmegaConf.is_dict(schema) else None
            if (
                isinstance(child, DictConfig)
                and len(child)
                and OmegaConf.get_type(child) is not dict
            ):
                walk(sub[key], child, full + ".")

    walk(node, OmegaConf.structured(schema or schema_of(node)), "")


def did_you_mean(key: str, schema: type[RunnerConfig]) -> str | None:
    """The schema's key closest to a dotted `key` it does not know (`train.lrr` -> `train.lr`),
    else None."""
    owner: Any = schema
    parts = key.lstrip("+~").split("=", 1)[0].split(".")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(owner):
            return None
        fields = {f.name: f for f in dataclasses.fields(owner)}
        if part not in fields:
            near = difflib.get_close_matches(part, list(fields), n=1)
            return ".".join([*parts[:i], near[0]]) if near else None
        kind = typing.get_type_hints(owner).get(part)
        owner = kind if dataclasses.is_dataclass(kind) else None
    return None


def entry_fields(schema: type[RunnerConfig], key: str) -> list[str]:
    """The fields each entry of the list setting `key` takes (`data.sources` -> source,
    num_samples, weight, ...), read from the schema; [] where `key` is not a list of records."""
    owner: Any = schema
    for part in key.split("."):
        if not dataclasses.is_dataclass(owner):
            return []
        owner = typing.get_type_hints(owner).get(part)
    args = typing.get_args(owner)
    return (
        [f.name for f in dataclasses.fields(args[0])]
        if args and dataclasses.is_dataclass(args[0])
        else []
    )


def typed(
    node: DictConfig | RunnerConfig, schema: type[RunnerConfig] | None = None
) -> RunnerConfig:
    """The composed config as `schema`'s dataclasses (unknown keys refused first); `schema` is
    the registry's (`schema_for(stages)`; default: the one the node was composed on) when
    stages bring settings of their own. Deprecated keys are moved to their new place, with a
    warning."""
    if isinstance(node, RunnerConfig):
        return node
    schema = schema or schema_of(node)
    return _resolved(_typed(node, schema))


def _resolved(cfg: RunnerConfig) -> RunnerConfig:
    """hardware.dtype: auto -> this machine's own format (runner/core/number_format.py), so that
    every stage, key and figure sees the format it computes in; then each section's `resolve`
    (a stage's defaults that depend on other sections); serving flags folded."""
    if cfg.hardware.dtype == Dtype.auto:
        cfg.hardware.dtype = Dtype(choose_dtype(str(cfg.hardware.device)).dtype)
    for section in cfg.sections():
        if callable(getattr(section, "resolve", None)):
            section.resolve(cfg)
    # Serving settings written as flags in hardware.vllm.extra_args are the typed keys'
    # (runner/core/serving_flags.py): every check and key reads them in one place.
    fold(cfg.hardware.vllm, cfg.hardware.env)
    return cfg


def _typed(node: DictConfig, schema: type[RunnerConfig]) -> RunnerConfig:
    check_known_keys(node, schema)
    node = OmegaConf.masked_copy(node, [k for k in node if k != "hydra"])
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node)
        return OmegaConf.to_object(merged)
    except MissingMandatoryValue as exc:  # e.g. model=hf without model.source
        missing = sorted(OmegaConf.missing_keys(node)) or [exc.full_key or "?"]
        also = f" (so are {', '.join(missing[1:])})" if len(missing) > 1 else ""
        raise ConfigError(missing[0], f"is required and has no value{also}; set it") from None
    except OmegaConfBaseException as exc:  # a wrong type or choice in a config built by hand
        raise ConfigError(exc.full_key or "?", exc.msg) from None
