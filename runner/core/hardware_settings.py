"""The `hardware` section: the box (device, GPUs, tensor parallelism, the number format, nodes,
the environment every process gets) and how the runner starts vLLM on it (`hardware.vllm`), with
their checks. Read by every stage; composed from conf/hardware/."""

from __future__ import annotations

import os
import shutil
import urllib.parse
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from runner.core.environment import check_env, keyed
from runner.core.errors import ConfigError
from runner.core.ranges import above, at_least, finite

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
        at_least("hardware.vllm.data_parallel", self.data_parallel, 1)
        at_least("hardware.vllm.ready_timeout_s", self.ready_timeout_s, 1)
        at_least("hardware.vllm.stop_timeout_s", self.stop_timeout_s, 1)
        if self.command:
            exe = self.command[0]
            if not (shutil.which(exe) or Path(exe).expanduser().is_file()):
                raise ConfigError(
                    "hardware.vllm.command",
                    f"{exe!r} is neither a file nor a command on PATH; give the python (or "
                    "container command) that runs vLLM, or [] for this environment's",
                )
        if self.endpoint is not None:
            check_url("hardware.vllm.endpoint", self.endpoint)
        for k, url in enumerate(self.endpoints):
            check_url(f"hardware.vllm.endpoints[{k}]", url)
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


def check_url(key: str, endpoint: str) -> None:
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
        at_least("hardware.num_gpus", self.num_gpus, 0)
        at_least("hardware.num_nodes", self.num_nodes, 1)
        at_least("hardware.node_wait_s", self.node_wait_s, 1)
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
            at_least("hardware.extract_tokens_per_s", self.extract_tokens_per_s, 1)
        if self.device == Device.cuda and self.num_gpus < 1:
            raise ConfigError("hardware.num_gpus", "is 0 but hardware.device is cuda; set >= 1")
        if self.device == Device.cpu and self.num_gpus:
            raise ConfigError(
                "hardware.num_gpus", f"is {self.num_gpus} but hardware.device is cpu; set 0"
            )
        at_least("hardware.tensor_parallel_size", self.tensor_parallel_size, 1)
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
        at_least("hardware.extract_batch_size", self.extract_batch_size, 1)
        if self.cpu_threads is not None:
            at_least("hardware.cpu_threads", self.cpu_threads, 1)
        if not 0 < self.vllm_memory_utilization <= 1:
            raise ConfigError(
                "hardware.vllm_memory_utilization",
                f"{self.vllm_memory_utilization} must be in (0, 1]",
            )
        if self.vllm_kv_cache_gib is not None:
            finite("hardware.vllm_kv_cache_gib", self.vllm_kv_cache_gib)
            above("hardware.vllm_kv_cache_gib", self.vllm_kv_cache_gib, 0)
        if self.gpu_memory_gib is not None:
            above("hardware.gpu_memory_gib", self.gpu_memory_gib, 0)
        kv, room = self.vllm_kv_cache_gib, memory_gib(self)
        if kv is not None and room is not None and kv > room * self.vllm_memory_utilization:
            where = "one GPU" if self.device == Device.cuda else "this machine's RAM"
            raise ConfigError(
                "hardware.vllm_kv_cache_gib",
                f"{kv:g} GiB of KV cache is more than {where} gives vLLM ({room:.0f} GiB x "
                f"hardware.vllm_memory_utilization {self.vllm_memory_utilization:g}); the server "
                "would fail at start, after the earlier stages",
            )
        self.vllm.check()


def memory_gib(hw: HardwareConfig) -> float | None:
    """Memory the KV cache competes for: one GPU's (hardware.gpu_memory_gib, when given), or on
    CPU this machine's RAM."""
    if hw.device == Device.cuda:
        return hw.gpu_memory_gib
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return None
