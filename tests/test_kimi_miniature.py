"""Kimi-K2.5 in miniature (model=kimi_k25_mini, runner/assets/miniatures.py): the real wrapper
class,
MLA and mixture-of-experts, the real checkpoint key names and a tokenizer that needs remote
code, at toy size with random weights, through every part of the runner.

- fast lane: the build is faithful; the plan refuses what vLLM cannot do with this architecture;
  prepare, transformers extraction (with its final-slot self-test), vocab and training run;
- vllm lane: extraction through vLLM's KimiK25ForConditionalGeneration agrees with transformers
  on every slot (the last one the pre-norm final state), and the vLLM backend's final-slot
  self-test catches a slot one layer off, injected through the server's flags;
- gpu: evaluation too (vLLM's CPU build cannot serve an MLA target with an EAGLE-3 draft).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from runner.assets.miniatures import KIMI_SPECIAL, ensure
from runner.core.errors import ConfigError, StageError
from tests.conftest import REPO, compose, gpu_lane_overrides, run_job

MINI = ["model=kimi_k25_mini", "data.num_samples=40", "train.epochs=1"]
UP_TO_TRAIN = "run.stages=[prepare,extract,vocab,train]"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kimi_mini")


@pytest.fixture(scope="module")
def mini(root) -> Path:
    return ensure("kimi_k25", root)


def test_the_miniature_is_kimi_k25_at_toy_size(mini):
    from transformers import AutoTokenizer

    config = json.loads((mini / "config.json").read_text())
    text = config["text_config"]
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert config["model_type"] == "kimi_k25" and "vision_config" in config
    assert text["num_hidden_layers"] == 4 and text["first_k_dense_replace"] == 1
    assert (text["n_routed_experts"], text["num_experts_per_tok"], text["n_shared_experts"]) == (
        4,
        2,
        1,
    )
    assert (text["kv_lora_rank"], text["qk_rope_head_dim"], text["q_lora_rank"]) == (512, 64, 32)
    with safe_open(str(mini / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        params = sum(int(torch.tensor(f.get_slice(k).get_shape()).prod()) for k in keys)
    print(f"miniature: {params:,} parameters, {len(keys)} tensors")
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in keys  # layer 0 dense
    assert "language_model.model.layers.1.mlp.experts.3.down_proj.weight" in keys
    assert "language_model.model.layers.1.mlp.shared_experts.up_proj.weight" in keys
    assert "language_model.model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in keys  # MLA
    assert {"language_model.lm_head.weight", "language_model.model.norm.weight"} <= keys
    assert any(k.startswith("vision_tower.") for k in keys)
    # The vision tower's settings under the real checkpoint's names (what vLLM reads), with the
    # values transformers builds the weights from.
    real = json.loads((REPO / "tests/data/kimi_k25/config.json").read_text())["vision_config"]
    vision = config["vision_config"]
    assert set(real) <= set(vision), sorted(set(real) - set(vision))
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        assert vision[f"vt_{name}"] == vision[name]
    for axis in ("height", "width", "time"):
        assert vision[f"init_pos_emb_{axis}"] == vision[f"pos_emb_{axis}"]
    with safe_open(str(mini / "model.safetensors"), "pt") as f:
        grid = f.get_slice("vision_tower.patch_embed.pos_emb.weight").get_shape()
    assert list(grid)[:2] == [vision["init_pos_emb_height"], vision["init_pos_emb_width"]]
    assert any(k.startswith("mm_projector.") for k in keys)
    # As with the real model, the tokenizer is custom code: nothing loads without consent.
    with pytest.raises(ValueError):
        AutoTokenizer.from_pretrained(mini)
    tok = AutoTokenizer.from_pretrained(mini, trust_remote_code=True)
    assert all(len(tok.encode(t, add_special_tokens=False)) == 1 for t in KIMI_SPECIAL)
    text_out = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
        thinking=False,
    )
    assert (
        text_out == "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant"
        "<|im_middle|><think></think>"
    )


def test_the_plan_refuses_what_vllm_cannot_do_with_this_architecture(root, mini):
    plan = [*MINI, f"run.output_root={root}", "run.plan_only=true"]
    with pytest.raises(ConfigError) as info:  # evaluate serves a draft: not on vLLM's CPU build
        run_job(compose(plan))
    assert info.value.key == "run.stages" and "No common block size" in info.value.message
    with pytest.raises(ConfigError) as info:  # vLLM's DeepSeek backbone cannot capture id 0
        run_job(compose([*plan, UP_TO_TRAIN, "extract=vllm", "model.capture_layers=[0,2,3]"]))
    assert info.value.key == "model.capture_layers"
    ok = run_job(compose([*plan, UP_TO_TRAIN, "extract=vllm"])).plan.render()
    assert "KimiK25ForConditionalGeneration: SupportsEagle3" in ok
    assert "language_model.model.layers x4" in ok


@pytest.fixture(scope="module")
def transformers_run(root, mini):
    return run_job(compose([*MINI, f"run.output_root={root}", UP_TO_TRAIN, "run.name=mini-tf"]))


def test_the_miniature_trains_through_the_transformers_backend(transformers_run):
    ext = transformers_run.results["extract"]
    assert ext.metrics["selftest_next_token_agreement"] >= 0.98  # the pre-norm final slot
    hs = load_file(str(ext.path / "hidden_states" / "hs_0.safetensors"))["hidden_states"]
    assert tuple(hs.shape[1:]) == (4, 64)
    draft = transformers_run.results["train"].path / "draft"
    conf = json.loads((draft / "config.json").read_text())
    assert conf["eagle3_runner"]["aux_layer_ids"] == [1, 2, 3]
    assert transformers_run.results["train"].metrics["steps"] > 0


@pytest.mark.vllm
def test_vllm_captures_every_slot_as_transformers_does(root, transformers_run):
    run = run_job(
        compose(
            [
                *MINI,
                f"run.output_root={root}",
                "extract=vllm",
                "run.stages=[prepare,extract]",
                "run.name=mini-vllm",
            ]
        )
    )
    m = run.results["extract"].metrics
    # The self-test read the final norm and LM head alone: 64 + 64 x vocab bf16 values.
    vocab = json.loads((Path(transformers_run.target.facts.path) / "config.json").read_text())[
        "text_config"
    ]["vocab_size"]
    assert m["selftest_bytes_read"] == 2 * (64 + 64 * vocab)
    assert m["selftest_next_token_agreement"] >= 0.95
    print(
        f"vLLM self-test: {m['selftest_next_token_agreement']:.3f} of "
        f"{m['selftest_positions']:.0f} decisive positions, read "
        f"{m['selftest_bytes_read']:.0f} bytes in {m['selftest_s']:.2f} s"
    )
    tf_dir = transformers_run.results["extract"].path / "hidden_states"
    vl_dir = run.results["extract"].path / "hidden_states"
    with safe_open(str(Path(transformers_run.target.facts.path) / "model.safetensors"), "pt") as f:
        norm_w = f.get_tensor("language_model.model.norm.weight").float()
    worst = [0.0] * 4
    post_norm_gap = []
    for i in range(8):
        a = load_file(str(tf_dir / f"hs_{i}.safetensors"))
        b = load_file(str(vl_dir / f"hs_{i}.safetensors"))
        assert torch.equal(a["token_ids"], b["token_ids"])
        x, y = a["hidden_states"].float(), b["hidden_states"].float()
        assert x.shape == y.shape, "vLLM dropped or added a slot"
        for s in range(4):
            worst[s] = max(worst[s], ((x[:, s] - y[:, s]).norm() / x[:, s].norm()).item())
        final = x[:, 3]
        post = final * torch.rsqrt(final.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w
        post_norm_gap.append(((post - y[:, 3]).norm() / post.norm()).item())
    print("relative error per slot (vLLM ids 1, 2, 3, 4):", [f"{w:.4f}" for w in worst])
    assert max(worst) < 0.02, "vLLM's states differ from transformers' beyond bf16"
    # The last slot is the pre-norm state: the post-norm one is far from it.
    assert min(post_norm_gap) > 10 * worst[3]


@pytest.mark.vllm
def test_the_vllm_self_test_catches_a_slot_one_layer_off(root, mini):
    # The server captures ids 1, 2, 3 while the runner expects 1, 2 and the final 4: the last
    # slot is one layer early, and the slot count still matches.
    ids = '{"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}'
    wrong = (
        '{"method": "extract_hidden_states", "num_speculative_tokens": 1, '
        f'"draft_model_config": {{"hf_config": {ids}}}}}'
    )
    with pytest.raises(StageError) as info:
        flags = f"hardware.vllm.extra_args=[--speculative-config,'{wrong}']"
        over = ["extract=vllm", "model.capture_layers=[1,2]", "run.stages=[prepare,extract]"]
        run_job(compose([*MINI, f"run.output_root={root}", *over, flags]))
    assert "final-slot self-test" in str(info.value) and "model.capture_layers" in str(info.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_whole_pipeline_with_evaluation_on_a_gpu(root, mini):
    run = run_job(
        compose(
            [
                *MINI,
                f"run.output_root={root}",
                "hardware=gpu1",
                # The GPU recipe's 32k draft vocab is twice the miniature's vocab.
                "vocab.draft_vocab_size=4096",
                "extract=vllm",
                "eval.num_prompts=8",
                "eval.max_new_tokens=32",
                "eval.gates=warn",  # a draft of a random target accepts nothing: 1.0 is right
                *gpu_lane_overrides(),
            ]
        )
    )
    ev = run.results["evaluate"].metrics
    keys = ("acceptance_length", "random_acceptance_length", "identical_to_target_fraction")
    figures = {k: ev.get(k) for k in (*keys, "near_ties", "mismatches", "server_start_s")}
    figures["extract"] = run.results["extract"].metrics
    figures["seconds"] = {k: r.seconds for k, r in run.results.items()}
    print(f"GPU-FIGURES kimi_mini {json.dumps(figures, default=str)}", flush=True)
    assert ev["acceptance_length"] >= 1.0
