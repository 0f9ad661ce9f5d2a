"""Model adapters: the text model, its layers, norm, embedding and head are found for plain causal
LMs and multimodal wrappers, from config.json alone (meta device) and on tiny real weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as T

from runner.assets.target_layout import get_module, layout_from_config, layout_from_model
from runner.core.layer_ids import capture_ids, from_output_of, hook_point, to_output_of

KIMI_CONFIG = Path(__file__).parent / "data" / "kimi_k25" / "config.json"


def text(**kw):
    d = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
    )
    d.update(kw)
    return d


VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
)
DSV3 = text(
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
)

FAMILIES = {
    "llama": (lambda: T.LlamaConfig(**text()), T.LlamaForCausalLM, "model.layers", "lm_head"),
    "deepseek_v3": (
        lambda: T.DeepseekV3Config(**DSV3),
        T.DeepseekV3ForCausalLM,
        "model.layers",
        "lm_head",
    ),
    "llava": (
        lambda: T.LlavaConfig(
            text_config=T.LlamaConfig(**text()), vision_config=T.CLIPVisionConfig(**VISION)
        ),
        T.LlavaForConditionalGeneration,
        "model.language_model.layers",
        "lm_head",
    ),
    "qwen2_vl": (
        lambda: T.Qwen2VLConfig(
            text_config=text(),
            vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2),
        ),
        T.Qwen2VLForConditionalGeneration,
        "model.language_model.layers",
        "lm_head",
    ),
    "qwen2_5_vl": (
        lambda: T.Qwen2_5_VLConfig(
            text_config=text(),
            vision_config=dict(
                depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64
            ),
        ),
        T.Qwen2_5_VLForConditionalGeneration,
        "model.language_model.layers",
        "lm_head",
    ),
    "gemma3": (
        lambda: T.Gemma3Config(text_config=text(head_dim=16), vision_config=VISION),
        T.Gemma3ForConditionalGeneration,
        "model.language_model.layers",
        "lm_head",
    ),
    "mistral3": (
        lambda: T.Mistral3Config(
            text_config=text(model_type="mistral"), vision_config=dict(VISION, head_dim=16)
        ),
        T.Mistral3ForConditionalGeneration,
        "model.language_model.layers",
        "lm_head",
    ),
    "llama4": (
        lambda: T.Llama4Config(
            text_config=text(num_local_experts=2, intermediate_size_mlp=128, head_dim=16),
            vision_config=dict(
                VISION, vision_output_dim=64, projector_input_dim=64, projector_output_dim=64
            ),
        ),
        T.Llama4ForConditionalGeneration,
        "language_model.model.layers",
        "language_model.lm_head",
    ),
}


def config_json(hf_config, arch: str) -> dict:
    d = hf_config.to_dict()
    d["architectures"] = [arch]
    return json.loads(json.dumps(d))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_layout_from_config_alone_matches_tiny_weights(family):
    make_cfg, cls, layers, head = FAMILIES[family]
    torch.manual_seed(0)
    model = cls(make_cfg()).eval()  # tiny real weights
    from_weights = layout_from_model(model)
    from_config = layout_from_config(config_json(make_cfg(), cls.__name__))
    assert from_weights.layers == from_config.layers == layers
    assert from_weights.lm_head == from_config.lm_head == head
    for f in (
        "norm",
        "embed",
        "num_layers",
        "hidden_size",
        "vocab_size",
        "num_attention_heads",
        "num_experts",
        "text_params",
    ):
        assert getattr(from_weights, f) == getattr(from_config, f), f
    assert (
        from_config.num_layers == 3
        and from_config.hidden_size == 64
        and from_config.vocab_size == 1000
    )
    assert from_config.architecture == cls.__name__
    assert len(get_module(model, from_weights.layers)) == 3


class KimiStandIn(torch.nn.Module):
    """Kimi-K2.5's nesting: vision tower + projector beside a DeepSeek-V3 `language_model`."""

    def __init__(self):
        super().__init__()
        self.config = T.PretrainedConfig()
        self.config.text_config = T.DeepseekV3Config(**DSV3)
        self.vision_tower = torch.nn.Module()
        self.vision_tower.encoder = torch.nn.Module()
        self.vision_tower.encoder.layers = torch.nn.ModuleList(
            torch.nn.Linear(8, 8) for _ in range(3)
        )
        self.mm_projector = torch.nn.Linear(8, 64)
        self.language_model = T.DeepseekV3ForCausalLM(self.config.text_config)


def test_kimi_nesting_from_config_and_from_weights():
    stand_in = KimiStandIn()
    found = layout_from_model(stand_in)
    assert (found.layers, found.norm, found.lm_head) == (
        "language_model.model.layers",
        "language_model.model.norm",
        "language_model.lm_head",
    )
    cfg = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": dict(T.DeepseekV3Config(**DSV3).to_dict(), model_type="kimi_k2"),
    }
    from_config = layout_from_config(json.loads(json.dumps(cfg)))
    assert (from_config.layers, from_config.norm, from_config.lm_head) == (
        found.layers,
        found.norm,
        found.lm_head,
    )
    assert from_config.num_experts == 4 and from_config.wrapper


def test_kimi_k25_full_config_without_weights():
    layout = layout_from_config(json.loads(KIMI_CONFIG.read_text()))
    assert layout.architecture == "KimiK25ForConditionalGeneration"
    assert (layout.num_layers, layout.hidden_size, layout.vocab_size) == (61, 7168, 163840)
    assert (layout.num_attention_heads, layout.num_experts, layout.experts_per_token) == (
        64,
        384,
        8,
    )
    assert (
        layout.layers == "language_model.model.layers"
        and layout.lm_head == "language_model.lm_head"
    )
    assert 1.0e12 < layout.text_params < 1.05e12  # ~1T parameters


def test_an_unknown_wrapper_asks_for_the_layout_override():
    cfg = {
        "architectures": ["SomeNewVLM"],
        "model_type": "some_new_vlm",
        "text_config": dict(T.LlamaConfig(**text()).to_dict()),
    }
    with pytest.raises(ValueError, match=r"model\.layout"):
        layout_from_config(json.loads(json.dumps(cfg)))
    layout = layout_from_config(
        json.loads(json.dumps(cfg)), {"text_model": "lm.model", "lm_head": "lm.lm_head"}
    )
    assert (layout.layers, layout.lm_head, layout.source) == (
        "lm.model.layers",
        "lm.lm_head",
        "override",
    )


def test_hooks_at_the_discovered_layers_capture_the_text_models_states():
    """On a wrapper (Llava), hooking the discovered layers gives the language model's own states."""
    make_cfg, cls, _, _ = FAMILIES["llava"]
    torch.manual_seed(0)
    model = cls(make_cfg()).eval()
    layout = layout_from_model(model)
    layers = get_module(model, layout.layers)
    got = {}
    hooks = [
        layers[i].register_forward_hook(
            lambda m, a, o, i=i: got.__setitem__(i, o[0] if isinstance(o, tuple) else o)
        )
        for i in range(3)
    ]
    ids = torch.randint(0, 1000, (1, 12))
    with torch.inference_mode():
        out = model(input_ids=ids, output_hidden_states=True)
    for h in hooks:
        h.remove()
    for k in (1, 2):  # vLLM id k = output of layer k-1 = hidden_states[k]
        _, i = hook_point(k, 3)
        torch.testing.assert_close(got[i], out.hidden_states[k])
    # id n = 3 is layer 2's output before the norm; hidden_states[3] is after it.
    torch.testing.assert_close(get_module(model, layout.norm)(got[2]), out.hidden_states[3])


# ---- one layer-id convention ---------------------------------------------------------------


def test_layer_id_conversions_pinned():
    # Kimi-K2.5 (61 layers): speculators/vLLM default [2, 30, 58] + 61.
    assert capture_ids([2, 30, 58], 61) == (2, 30, 58, 61)
    assert to_output_of([2, 30, 58, 61]) == [
        1,
        29,
        57,
        60,
    ]  # the EAGLE paper's / ModelOpt's numbers
    assert from_output_of([1, 29, 57]) == [2, 30, 58]
    # SmolLM2 (30 layers): ids 2, 15, 27 and the final 30 (pre-norm).
    assert [hook_point(k, 30) for k in (2, 15, 27, 30)] == [
        ("post", 1),
        ("post", 14),
        ("post", 26),
        ("post", 29),
    ]
    assert hook_point(0, 30) == ("pre", 0)  # the embedding output
    with pytest.raises(ValueError):
        hook_point(31, 30)
