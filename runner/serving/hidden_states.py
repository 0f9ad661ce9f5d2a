"""The flags of a vLLM server that captures hidden states: vLLM's `extract_hidden_states`
speculative method (capture ids in vLLM's convention, the final layer before the norm included)
and its hidden-states connector, which writes one safetensors file per request (on CPU the
runner's own connector, runner.integrations.vllm_cpu_connector). Extraction (`extract=vllm`) and
online training (`extract=online`) start the same server.
"""

from __future__ import annotations

import json
from pathlib import Path

from runner.assets.target_facts import ModelFacts
from runner.core.schema import RunnerConfig
from runner.serving.vllm_server import engine_args

CPU_CONNECTOR_MODULE = "runner.integrations.vllm_cpu_connector"


# extract.batch_tokens on a GPU when unset.
GPU_EXTRACT_BATCH_TOKENS = 16384


def batch_tokens(cfg: RunnerConfig) -> int | None:
    """Tokens an extraction server runs in one step (extract.batch_tokens; at least one row);
    None: vLLM's own (on a CPU, when unset)."""
    step = cfg.extract.batch_tokens
    if step is None:
        if cfg.hardware.device == "cpu":
            return None
        # vLLM's own step, with chunked prefill off, is one context (2,049 tokens here: about
        # four rows a step); prefill-only requests gain from more a step.
        step = GPU_EXTRACT_BATCH_TOKENS
    return max(step, cfg.data.max_seq_len + 1)


def server_args(cfg: RunnerConfig, facts: ModelFacts, staging: Path) -> list[str]:
    """Flags for an extraction server, all derived from the composed config."""
    cpu = cfg.hardware.device == "cpu"
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": list(facts.extract_ids)}
        },
    }
    kv = {
        "kv_connector": "CpuHiddenStatesConnector" if cpu else "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(staging)},
    }
    if cpu:
        kv["kv_connector_module_path"] = CPU_CONNECTOR_MODULE
    step = batch_tokens(cfg)
    batch = ["--max-num-batched-tokens", str(step)] if step else []
    # Each prepared row plus the one generated token.
    return [
        *engine_args(cfg, cfg.data.max_seq_len + 1),
        *batch,
        # Both corrupt captured states in some vLLM versions (speculators #279, #283, #994).
        "--no-enable-chunked-prefill",
        "--no-enable-prefix-caching",
        "--speculative-config",
        json.dumps(spec),
        "--kv-transfer-config",
        json.dumps(kv),
    ]
