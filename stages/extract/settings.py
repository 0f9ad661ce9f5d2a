"""The extract stage's settings (`extract.*`): the backend, how states are stored, offline or
online, the vLLM requests' limits; their checks, their rules against other sections, and the
extraction policy other code asks for (requests in flight, tokens a server step)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from runner.core.errors import ConfigError
from runner.core.layer_ids import CAPTURE_PRESETS
from runner.core.ranges import at_least

if TYPE_CHECKING:
    from runner.core.schema import RunnerConfig


class ExtractBackend(StrEnum):
    # In-process transformers forward with hooks (small and medium targets).
    transformers = "transformers"
    # A vLLM server the runner starts (targets only an engine can hold).
    vllm = "vllm"


class ExtractMode(StrEnum):
    # Hidden states are extracted once, stored (extract.storage) and read by every epoch.
    offline = "offline"
    # Nothing is stored: training fetches each sample's states from a live vLLM server
    # (speculators' --vllm-endpoint), every epoch again.
    online = "online"


class Storage(StrEnum):
    # The target's dtype as it computes (hardware.dtype, bfloat16 by default): 2 bytes a value.
    bf16 = "bf16"
    # float8_e4m3fn with one fp32 scale per token (hs-connectors' format, which speculators'
    # fp8 backend reads): about half the bytes.
    fp8 = "fp8"


# Extraction backends (stages/extract/: one module each).
EXTRACT_BACKENDS = tuple(b.value for b in ExtractBackend)


@dataclass
class ExtractConfig:
    # transformers: in-process Hugging Face forward with hooks (small and medium targets).
    # vllm: a vLLM server the runner starts (extract_hidden_states method + hidden-states
    # connector), one request per row (targets only an engine can hold).
    backend: ExtractBackend = ExtractBackend.transformers
    # How hidden states are stored: bf16 (the target's dtype) or fp8 (per-token scaled e4m3,
    # read by speculators' fp8 backend with no conversion step). Statistics come from the
    # full-precision values either way.
    storage: Storage = Storage.bf16
    # offline: extract once, store, train from the files. online: store nothing; training fetches
    # each sample from a vLLM server (started by the train stage, or hardware.vllm.endpoint),
    # every epoch again. Online needs backend vllm.
    mode: ExtractMode = ExtractMode.offline
    # vLLM backend: requests in flight, seconds per request, and retries per sample before the
    # stage fails naming it. Requests in flight, null: 64 on a GPU (a step of 16,384 tokens holds
    # about 35 rows of 470 tokens; fewer in flight leave steps part-empty), 8 on a CPU.
    concurrency: int | None = None
    # Tokens the extraction server runs in one step (vLLM --max-num-batched-tokens; chunked
    # prefill is off, so a row is never split, and a step holds at least one). null: 16,384 on a
    # GPU, vLLM's own default on a CPU.
    batch_tokens: int | None = None
    request_timeout_s: int = 600
    max_retries: int = 3
    # Online on a box with no GPU left over for training (e.g. one GPU): the fraction of each
    # serving GPU's memory the train stage's server may take, training sharing those GPUs with
    # the rest. null: the server gets GPUs of its own (the last tensor_parallel_size).
    share_gpu: float | None = None
    # Extract these presets' layers too (a sweep sets the union of its choices here, so that all
    # its jobs share one extraction and each trains on its own slots).
    superset_presets: list[str] = field(default_factory=list)

    def check(self) -> None:
        if self.mode == ExtractMode.online and self.backend != ExtractBackend.vllm:
            raise ConfigError(
                "extract.backend",
                f"is {self.backend}, but extract.mode=online fetches hidden states from a vLLM "
                "server; use extract=online (backend vllm, mode online) or extract.mode=offline",
            )
        if self.concurrency is not None:
            at_least("extract.concurrency", self.concurrency, 1)
        if self.batch_tokens is not None:
            at_least("extract.batch_tokens", self.batch_tokens, 16)
        if self.share_gpu is not None and not 0.05 <= self.share_gpu <= 0.9:
            raise ConfigError(
                "extract.share_gpu",
                f"{self.share_gpu} must be between 0.05 and 0.9 (the fraction of each serving "
                "GPU's memory the online server takes; training gets the rest)",
            )
        at_least("extract.request_timeout_s", self.request_timeout_s, 1)
        at_least("extract.max_retries", self.max_retries, 0)
        unknown = [p for p in self.superset_presets if p not in CAPTURE_PRESETS]
        if unknown:
            raise ConfigError(
                "extract.superset_presets",
                f"unknown preset(s) {unknown}; choose from {sorted(CAPTURE_PRESETS)}",
            )

    def check_across(self, cfg: RunnerConfig) -> None:
        """Online states come from one server, on the first node."""
        hw = cfg.hardware
        if hw.num_nodes > 1 and self.mode == ExtractMode.online:
            raise ConfigError(
                "hardware.num_nodes",
                "online training on several nodes is not supported (the states come from one "
                "server on the first node); extract offline (extract.mode=offline), then train",
            )
        several = hw.vllm.endpoints or hw.vllm.data_parallel > 1
        if several and self.mode == ExtractMode.online:
            raise ConfigError(
                "hardware.vllm.endpoints" if hw.vllm.endpoints else "hardware.vllm.data_parallel",
                "online training fetches its states from one server (speculators' "
                "--vllm-endpoint); use hardware.vllm.endpoint, or extract.mode=offline to extract "
                "through several",
            )


def concurrency(cfg: RunnerConfig) -> int:
    """Extraction requests in flight (extract.concurrency, or its default for the device)."""
    if cfg.extract.concurrency is not None:
        return cfg.extract.concurrency
    return 8 if cfg.hardware.device == "cpu" else 64
