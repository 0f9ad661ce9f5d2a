"""Preflight: the plan is computed from config files alone, and each wrong config fails there,
before any weight loads, naming the key to change."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.core.errors import ConfigError
from tests.conftest import compose, run_job

KIMI = str(Path(__file__).parent / "data" / "kimi_k25")
# 100 rows x 512 tokens of Kimi hidden states plan 2.7 GiB: the plan's disk check must not depend
# on how full the test machine's disk is (800 rows would need 21.9 GiB free).
# The design card's command, nothing else: the hardware selects the GPU training recipe.
KIMI_BOX = [
    "model=kimi_k25",
    f"model.source={KIMI}",
    "hardware=blackwell8",
    "run.plan_only=true",
    "data.num_samples=100",
]


def plan(tmp_path, *overrides):
    return run_job(compose([*KIMI_BOX, f"run.output_root={tmp_path}", *overrides]))


def test_kimi_on_blackwell8_plan_from_config_json_alone(tmp_path, capsys):
    result = plan(tmp_path)
    p, facts, layout = result.plan, result.target.facts, result.target.layout
    assert facts.capture_ids == (2, 30, 58, 61)
    assert layout.layers == "language_model.model.layers"
    n = p.numbers
    assert n["bytes_per_token"] == 4 * 7168 * 2 + 8  # 56 KiB of hidden states per token
    assert n["teacher_logits_bytes"] == 8192 * 32000 * 4
    assert n["full_vocab_logits_bytes"] == 8192 * 163840 * 4  # 640 KiB per token at full vocab
    assert (
        60 * 2**30 < n["weight_bytes_per_gpu"] < 75 * 2**30
    )  # INT4 experts: ~69 GB per GPU at TP 8
    out = capsys.readouterr().out
    for text in (
        "[1, 29, 57, 60]",
        "NCCL_P2P_LEVEL=SYS",
        "TP 8",
        "384 experts",
        "needs >= 0.18.0",
        "prepare:run",
    ):
        assert text in out, text
    assert not p.errors
    # GPU recipe (8k packs, 32k draft vocab) on all eight GPUs, and its memory per GPU.
    assert "8 GPU(s) (torchrun, DDP" in out
    assert 28 * 2**30 < n["train_memory_bytes"] < 45 * 2**30 < 96 * 2**30


@pytest.mark.parametrize(
    "overrides,key",
    [
        (
            ["model.capture_layers=[2,30,61]"],
            "model.capture_layers",
        ),  # past the last aux layer (61 = n)
        (["model.capture_layers=[2,30,30]"], "model.capture_layers"),  # duplicates
        (["hardware.tensor_parallel_size=3"], "hardware.tensor_parallel_size"),  # 64 heads
        (
            ["hardware.tensor_parallel_size=4", "hardware.num_gpus=4"],
            "hardware.tensor_parallel_size",
        ),  # 138 GiB/GPU > 96
        (["vocab.draft_vocab_size=200000"], "vocab.draft_vocab_size"),  # above 163,840
        (["data.num_samples=1000000000"], "data.num_samples"),  # hidden states exceed free disk
        (
            ["model.trust_remote_code=false"],
            "model.trust_remote_code",
        ),  # its tokenizer is custom code
        (["model.num_layers=60"], "model.num_layers"),  # declared fact vs config.json
        (["model.architecture=DeepseekV3ForCausalLM"], "model.architecture"),
        (["+model._target_=os.system"], "model._target_"),  # the runner instantiates nothing
        (["train.total_seq_len=131072"], "train.total_seq_len"),  # logits alone exceed 96 GB
        (["train.optimizer=adamw", "train.num_layers=8"], "train.fsdp"),  # 8-layer draft state
        # Online: serving at TP 8 takes the whole box, nothing is left to train on.
        (["extract=online"], "extract.mode"),
        (
            [
                "extract=online",
                "hardware.tensor_parallel_size=4",
                "hardware.num_gpus=8",
                "model.weights_gib=300",
                "train.num_gpus=8",
            ],
            "train.num_gpus",
        ),
        # One server cannot both capture hidden states and serve the draft.
        (["extract=online", "hardware.vllm.endpoint=http://127.0.0.1:9"], "hardware.vllm.endpoint"),
        # A server that does not answer.
        (
            [
                "extract=online",
                "hardware.vllm.endpoint=http://127.0.0.1:9",
                "run.stages=[prepare,extract,vocab,train]",
            ],
            "hardware.vllm.endpoint",
        ),
    ],
)
def test_wrong_config_fails_in_preflight_with_the_key(tmp_path, overrides, key):
    with pytest.raises(ConfigError) as info:
        plan(tmp_path, *overrides)
    assert info.value.key == key


def test_trust_remote_code_only_when_needed(tmp_path, tiny_model_dir):
    cfg = [
        "model=hf",
        f"model.source={tiny_model_dir}",
        "model.name=tiny",
        "model.capture_layers=[1,2,3]",
        "vocab.draft_vocab_size=512",
        "run.plan_only=true",
        f"run.output_root={tmp_path}",
    ]
    assert run_job(compose(cfg)).target.facts.num_layers == 4
    with pytest.raises(ConfigError) as info:
        run_job(compose([*cfg, "model.trust_remote_code=true"]))
    assert info.value.key == "model.trust_remote_code"


def test_an_old_vllm_is_refused_for_kimi(tmp_path, monkeypatch):
    import runner.engine.preflight as pf

    monkeypatch.setattr(pf, "installed", lambda *names: ("vllm", "0.17.1"))
    with pytest.raises(ConfigError) as info:
        plan(tmp_path)
    assert info.value.key == "run.stages" and "0.18.0" in info.value.message


def test_a_vllm_the_runner_was_not_checked_with_is_refused_unless_allowed(
    tmp_path, monkeypatch, capsys
):
    import runner.engine.preflight as pf

    # vLLM 0.33 (what an unpinned `pip install vllm` resolved to, with torch 2.14) is newer than
    # Kimi needs, but no version the integrations were run with.
    monkeypatch.setattr(pf, "installed", lambda *names: ("vllm", "0.33.0"))
    with pytest.raises(ConfigError) as info:
        plan(tmp_path)
    assert info.value.key == "hardware.vllm.allow_unchecked_version"
    assert "vllm 0.33.0" in info.value.message and "vllm 0.26.0" in info.value.message
    allowed = plan(tmp_path, "hardware.vllm.allow_unchecked_version=true").plan
    assert [p.level for p in allowed.problems if "0.33.0" in p.message] == ["warning"]
    # The checked GPU build plans as it did.
    monkeypatch.setattr(pf, "installed", lambda *names: ("vllm", "0.26.0"))
    assert "installed vllm 0.26.0" in plan(tmp_path).plan.render()


def test_default_speculators_layers_collide_on_a_four_layer_model(tmp_path, tiny_model_dir):
    # [2, n//2, n-3] = [2, 2, 1] for n = 4: vLLM would crash on the duplicate; caught here,
    # naming the preset, from how many layers it works, and the key that lists ids instead.
    with pytest.raises(ConfigError) as info:
        run_job(
            compose(
                [
                    "model=hf",
                    f"model.source={tiny_model_dir}",
                    "model.name=tiny",
                    "vocab.draft_vocab_size=512",
                    "run.plan_only=true",
                    f"run.output_root={tmp_path}",
                ]
            )
        )
    assert info.value.key == "model.capture_preset"
    assert "[2, 2, 1]" in info.value.message and ">= 7 layers" in info.value.message
    assert "model.capture_layers" in info.value.message


def test_a_target_class_without_eagle3_support_in_vllm_is_refused(tmp_path, smollm2_tokenizer):
    # vLLM 0.32's Gemma3ForCausalLM does not implement SupportsEagle3: extraction through vLLM and
    # serving with a draft cannot work, and preflight says so before any weight loads.
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    target = tmp_path / "gemma3"
    Gemma3ForCausalLM(cfg).save_pretrained(target)
    smollm2_tokenizer.save_pretrained(target)
    base = [
        "model=hf",
        f"model.source={target}",
        "model.name=g3",
        "model.capture_layers=[1,2,3]",
        "vocab.draft_vocab_size=512",
        "run.plan_only=true",
        f"run.output_root={tmp_path}",
    ]
    with pytest.raises(ConfigError) as info:
        run_job(compose([*base, "extract=vllm"]))
    assert info.value.key == "model.architecture"
    assert "Gemma3ForCausalLM" in info.value.message and "SupportsEagle3" in info.value.message
    # Without vLLM stages the same target plans fine (transformers extraction, training only).
    assert not run_job(compose([*base, "run.stages=[prepare,extract,vocab,train]"])).plan.errors


def test_a_vllm_without_hidden_state_extraction_is_refused_for_the_vllm_backend(
    tmp_path, monkeypatch
):
    import runner.engine.preflight as pf

    # What the probe answers for a vLLM that predates the extract_hidden_states method.
    monkeypatch.setattr(
        pf,
        "vllm_eagle3_support",
        lambda arch, version: {
            "known": True,
            "eagle3": True,
            "cls": f"vllm.{arch}",
            "extract_hidden_states": False,
        },
    )
    with pytest.raises(ConfigError) as info:
        plan(tmp_path, "extract=vllm")
    assert info.value.key == "extract.backend" and "extract_hidden_states" in info.value.message
    assert not plan(tmp_path).plan.errors  # the transformers backend does not need it


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["model.capture_layers=[0,2,4]"], "model.capture_layers"),  # 4 = n is appended
        (["model.capture_layers=[1,1,3]"], "model.capture_layers"),  # duplicates
        (["model.capture_layers=[3,1]"], "model.capture_layers"),  # not ascending
        (["model.capture_layers=[-1,2]"], "model.capture_layers"),
        (
            ["model.capture_layers=[1,2,3]", "extract.superset_presets=[default]"],
            "extract.superset_presets",
        ),  # [2, 2, 1] on 4 layers
        (
            ["model.capture_layers=[1,2,3]", "vocab.draft_vocab_size=60000"],
            "vocab.draft_vocab_size",
        ),  # above 49,152
        (["model.capture_layers=[1,2,3]", "model.vocab_size=32000"], "model.vocab_size"),
    ],
)
def test_config_against_the_targets_facts(tmp_path, tiny_model_dir, overrides, key):
    base = [
        "model=hf",
        f"model.source={tiny_model_dir}",
        "model.name=tiny",
        "run.plan_only=true",
        f"run.output_root={tmp_path}",
    ]
    with pytest.raises(ConfigError) as info:
        run_job(compose([*base, *overrides]))
    assert info.value.key == key


def test_weights_estimate_counts_int4_experts_and_bf16_rest():
    from runner.assets.target_facts import weight_bytes
    from runner.assets.target_layout import TargetLayout

    layout = TargetLayout(
        architecture="X",
        wrapper=False,
        text_model="model",
        layers="model.layers",
        norm="model.norm",
        embed="model.embed_tokens",
        lm_head="lm_head",
        num_layers=4,
        hidden_size=8,
        vocab_size=100,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_experts=4,
        experts_per_token=2,
        tie_word_embeddings=False,
        text_params=10_000,
        source="model",
    )
    plain = {"num_hidden_layers": 4}
    w = weight_bytes(layout, plain)
    assert (w.bytes, w.kind, w.certain) == (20_000.0, "bf16", True)
    quant = {
        "first_k_dense_replace": 1,
        "moe_intermediate_size": 2,
        "quantization_config": {
            "config_groups": {"g": {"weights": {"num_bits": 4, "group_size": 32}}}
        },
    }
    experts = 3 * 4 * 3 * 8 * 2  # MoE layers x experts x (gate, up, down) x hidden x inter
    w = weight_bytes(layout, quant)
    assert w.kind == "routed experts int4, rest bf16" and w.certain
    assert w.bytes == experts * (0.5 + 2 / 32) + (10_000 - experts) * 2
    # A quantization it cannot size: bf16 assumed, said so, and marked uncertain...
    packed = {
        "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    }
    w = weight_bytes(layout, packed)
    assert not w.certain and "ASSUMED bf16" in w.kind and "model.weights_gib" in w.kind
    # ... until the size is stated.
    w = weight_bytes(layout, packed, stated_gib=1.5)
    assert w.certain and w.bytes == 1.5 * 2**30


def test_the_filesystem_of_the_output_root_is_read_from_the_mounts(tmp_path):
    from runner.engine.preflight import LOCAL_FILESYSTEMS, filesystem_of

    kind = filesystem_of(tmp_path / "not" / "yet" / "there")
    assert kind != "unknown" and kind == filesystem_of(tmp_path)
    assert "ext4" in LOCAL_FILESYSTEMS and "nfs4" not in LOCAL_FILESYSTEMS


# A size to cost: the packaged ShareGPT holds 17,528 conversations, so 300k leaves none held out
# (which the plan refuses); a box that trains this reads a larger dataset.
KIMI_300K_ROWS = [
    "data.num_samples=300000",
    "data.max_seq_len=4096",
    "eval.prompts=[mtbench,humaneval]",
]


@pytest.mark.parametrize(
    "free_tib,storage,key",
    [(40, "bf16", "extract.storage"), (40, "fp8", None), (10, "fp8", "data.num_samples")],
)
def test_kimi_at_300k_samples_plans_terabytes_and_refuses_what_the_disk_cannot_hold(
    tmp_path, monkeypatch, free_tib, storage, key
):
    import stages.extract

    monkeypatch.setattr(stages.extract, "free_bytes", lambda _path: free_tib * 2**40)
    over = [*KIMI_300K_ROWS, f"extract.storage={storage}"]
    if key is None:
        p = plan(tmp_path, *over).plan
        assert not p.errors
    else:
        with pytest.raises(ConfigError) as info:
            plan(tmp_path, *over)
        assert info.value.key == key
        return
    tokens = 300_000 * 4096
    n = p.numbers
    assert n["bytes_per_token"] == 4 * 7168 + 4 + 8  # fp8 values, an fp32 scale, the token id
    assert n["bytes_per_token_bf16"] == 4 * 7168 * 2 + 8
    assert n["hidden_state_bytes"] == tokens * (4 * 7168 + 12)  # 32.1 TiB; bf16 would be 64.1
    assert "fp8: 28.0 KiB/token" in p.render() and "32.1 TiB" in p.render()
    assert "bf16: 56.0 KiB/token, 64.1 TiB" in p.render()


def test_kimi_online_plans_no_disk_and_splits_gpus_or_uses_an_endpoint(tmp_path):
    over = [*KIMI_300K_ROWS, "extract=online"]
    # Half the box serves (TP 4 fits INT4 Kimi only with a weights figure that says so), half
    # trains: the plan names both sets.
    p = plan(tmp_path, *over, "hardware.tensor_parallel_size=4", "model.weights_gib=300").plan
    text = p.render()
    assert "online: nothing stored; 1,228,800,000 tokens" in text
    assert "64.1 TiB in bf16, 32.1 TiB in fp8" in text
    assert "vLLM serves on GPU(s) 4,5,6,7 (TP 4); training on the first 4" in text
    assert p.numbers["hidden_state_bytes"] == 0 and not p.errors


def test_kimi_offline_plan_shows_the_write_bandwidth_it_needs(tmp_path, monkeypatch):
    import stages.extract

    monkeypatch.setattr(stages.extract, "free_bytes", lambda _path: 40 * 2**40)
    over = [*KIMI_300K_ROWS, "extract.storage=fp8"]
    p = plan(tmp_path, *over).plan
    # blackwell8's planned 10,000 tokens/s x 28,684 bytes/token.
    assert p.numbers["write_bytes_per_s"] == 10_000 * (4 * 7168 + 12)
    assert "273.6 MiB/s at 10,000 tokens/s (hardware.extract_tokens_per_s)" in p.render()


def test_online_on_one_gpu_is_refused_unless_the_gpu_is_shared(tmp_path):
    """One GPU cannot give the online server GPUs of its own: the refusal names the sharing
    setting; with it, the plan states the server's memory share and training shares the GPU."""
    one = ["hardware=gpu1", "extract=online", "run.plan_only=true", f"run.output_root={tmp_path}"]
    with pytest.raises(ConfigError) as info:
        run_job(compose(one))
    assert info.value.key == "extract.mode" and "extract.share_gpu=0.3" in str(info.value)
    result = run_job(compose([*one, "extract.share_gpu=0.3"]))
    text = result.plan.render()
    assert "vLLM serves on GPU(s) 0 (TP 1) with 30% of their memory (extract.share_gpu)" in text
    assert not result.plan.errors

    from runner.core.schema import typed
    from stages.train.online import serving_gpus, sharing_args
    from stages.train.settings import train_ranks

    cfg = typed(compose([*one, "extract.share_gpu=0.3"]))
    assert train_ranks(cfg) == 1 and serving_gpus(cfg) == ["0"]
    args = sharing_args(cfg, ["--gpu-memory-utilization", "0.85", "--seed", "0"])
    assert args == ["--gpu-memory-utilization", "0.3", "--seed", "0"]
    with pytest.raises(ConfigError) as info:
        run_job(compose([*one, "extract.share_gpu=0.95"]))
    assert info.value.key == "extract.share_gpu"


def test_the_extraction_servers_step_size_is_a_setting_that_holds_a_row(tmp_path):
    """extract.batch_tokens reaches the server as --max-num-batched-tokens, never below one row
    (chunked prefill is off, so a longer row could not be scheduled); unset, vLLM decides on a
    CPU."""
    from runner.core.schema import typed
    from runner.serving.hidden_states import server_args
    from stages.extract.settings import concurrency

    def cfg(*over):
        return typed(compose(["extract=vllm", f"run.output_root={tmp_path}", *over]))

    class Facts:
        extract_ids = (1, 2, 3)

    args = server_args(cfg("extract.batch_tokens=65536"), Facts(), tmp_path)
    assert args[args.index("--max-num-batched-tokens") + 1] == "65536"
    short = server_args(cfg("extract.batch_tokens=100"), Facts(), tmp_path)
    assert short[short.index("--max-num-batched-tokens") + 1] == "257"  # data.max_seq_len + 1
    assert "--max-num-batched-tokens" not in server_args(cfg(), Facts(), tmp_path)
    # On a GPU, unset: 16,384 (vLLM's own is one context, a few rows a step).
    gpu = server_args(cfg("hardware=gpu1"), Facts(), tmp_path)
    assert gpu[gpu.index("--max-num-batched-tokens") + 1] == "16384"
    # Requests in flight to fill such steps: 64 on a GPU unless set; 8 on a CPU.
    assert concurrency(cfg("hardware=gpu1")) == 64 and concurrency(cfg()) == 8
    assert concurrency(cfg("hardware=gpu1", "extract.concurrency=16")) == 16


def test_data_parallel_extraction_gives_each_server_its_own_gpus(tmp_path, monkeypatch):
    """hardware.vllm.data_parallel: N servers of tensor_parallel_size GPUs each, in slices of the
    visible GPUs (a Slurm allocation's when it sets CUDA_VISIBLE_DEVICES); more than the box has
    is refused naming the key."""
    from runner.core.schema import typed
    from runner.serving.server_pool import gpu_slices, server_count

    # INT4 Kimi fits TP 4 only with a weights figure that says so (as in the online test).
    four = ["extract=vllm", "hardware.tensor_parallel_size=4", "model.weights_gib=300"]
    p = plan(tmp_path, *four, "hardware.vllm.data_parallel=2").plan
    assert "2 vLLM servers started side by side" in p.render()
    assert "GPUs 0,1,2,3 | 4,5,6,7" in p.render() and not p.errors
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,6,5,4,3,2,1,0")
    cfg = typed(compose([*KIMI_BOX, *four, "hardware.vllm.data_parallel=2"]))
    assert gpu_slices(cfg) == ["7,6,5,4", "3,2,1,0"] and server_count(cfg) == 2
    with pytest.raises(ConfigError) as info:
        plan(tmp_path, *four, "hardware.vllm.data_parallel=3")
    assert info.value.key == "hardware.vllm.data_parallel" and "need 12 GPUs" in info.value.message


def test_extraction_endpoints_are_each_asked_and_one_that_is_down_is_only_a_warning(tmp_path):
    """hardware.vllm.endpoints: each server is asked in the plan; one that does not answer is a
    warning (the others would take its rows), none answering is an error."""
    from runner.serving.vllm_server import free_port

    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    over = ["extract=vllm", f"hardware.vllm.endpoints=[{dead[0]},{dead[1]}]"]
    with pytest.raises(ConfigError) as info:
        plan(tmp_path, *over)
    assert info.value.key == "hardware.vllm.endpoints" and "none of the 2" in info.value.message
    result = plan(
        tmp_path, *over[:1], f"hardware.vllm.endpoints=[{dead[0]}]", "run.stages=[prepare]"
    )
    assert "no stage of this run uses them" in result.plan.render()
