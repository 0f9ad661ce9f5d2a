"""The serving settings (hardware.vllm.attention_backend, draft_attention_backend,
kv_cache_dtype, rejection_sample_method, cudagraph_mode): the 8x RTX PRO 6000 preset serves Kimi
as the field does, every server the runner starts gets them, the card's serve command carries
them, and the plan refuses what would serve a draft at zero acceptance or not at all, in
seconds, naming the key."""

from __future__ import annotations

import json
import shlex
from types import SimpleNamespace

import pytest

from runner.core.errors import ConfigError
from runner.core.schema import typed
from tests.conftest import compose, run_job

# The design card's Kimi-K2.5 on 8x RTX PRO 6000, planned from its config.json alone.
from tests.test_preflight import KIMI_BOX, plan


def test_the_rtx_pro_6000_box_serves_kimi_with_triton_mla_and_says_so(tmp_path, capsys):
    cfg = typed(compose(KIMI_BOX)).hardware.vllm
    assert cfg.serving() == {
        "attention_backend": "TRITON_MLA",
        "kv_cache_dtype": "fp8",
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "draft_attention_backend": "TRITON_ATTN",
        "rejection_sample_method": "standard",
    }
    result = plan(tmp_path)
    assert not result.plan.errors
    out = capsys.readouterr().out
    assert "attention_backend TRITON_MLA" in out and "(MLA target)" in out
    # What the installed vLLM has of the fixes the field needed on this box.
    assert "vLLM fixes" in out and "draft backend split" in out


@pytest.mark.parametrize(
    "override,why",
    [
        # The silent zero: no error from vLLM, acceptance 1.00.
        ("hardware.vllm.attention_backend=FLASHINFER_MLA", "zero acceptance"),
        # A standard-attention kernel for an MLA target: vLLM refuses it after launch.
        ("hardware.vllm.attention_backend=FLASH_ATTN", "the target uses MLA"),
        # The drafts this runner trains have standard attention.
        ("hardware.vllm.draft_attention_backend=TRITON_MLA", "standard attention"),
        ("hardware.vllm.attention_backend=TRITON_MLAA", "did you mean TRITON_MLA"),
        ("hardware.vllm.kv_cache_dtype=fp9", "did you mean fp8"),
        ("hardware.vllm.cudagraph_mode=FULL_AND_PIECEWIS", "did you mean FULL_AND_PIECEWISE"),
        ("hardware.vllm.rejection_sample_method=synthetic", "not the draft's"),
        ("hardware.vllm.attention_backend=CPU_ATTN", "CPU kernel"),
    ],
)
def test_the_plan_refuses_serving_settings_that_cannot_work(tmp_path, override, why):
    with pytest.raises(ConfigError) as refused:
        plan(tmp_path, override)
    assert refused.value.key == override.split("=")[0]
    assert why in refused.value.message


def test_the_silent_zero_is_refused_on_any_12x_gpu_and_allowed_elsewhere(tmp_path):
    from runner.serving.settings import problems

    base = typed(compose([*KIMI_BOX, "hardware.vllm.attention_backend=FLASHINFER_MLA"])).hardware
    assert any("zero acceptance" in m for _, m in problems(base, target_mla=True))
    # Named by capability rather than kind, or with an unquantized KV cache: no refusal.
    other = typed(
        compose(
            [
                *KIMI_BOX,
                "hardware.vllm.attention_backend=FLASHINFER_MLA",
                "hardware.gpu_kind=null",
                "hardware.compute_capability='12.0'",
            ]
        )
    ).hardware
    assert any("zero acceptance" in m for _, m in problems(other, target_mla=True))
    for change in (["hardware.compute_capability='10.0'"], ["hardware.vllm.kv_cache_dtype=auto"]):
        fine = typed(
            compose(
                [
                    *KIMI_BOX,
                    "hardware.vllm.attention_backend=FLASHINFER_MLA",
                    "hardware.gpu_kind=null",
                    "hardware.compute_capability='12.0'",
                    *change,
                ]
            )
        ).hardware
        assert not problems(fine, target_mla=True), change


def test_leaving_the_mla_kernel_to_vllm_on_this_box_is_a_warning(tmp_path):
    result = plan(tmp_path, "hardware.vllm.attention_backend=null")
    assert not result.plan.errors
    assert any(
        p.level == "warning"
        and p.key == "hardware.vllm.attention_backend"
        and "FLASHINFER_MLA" in p.message
        for p in result.plan.problems
    )


def test_a_standard_attention_target_on_the_box_is_told_to_unset_the_mla_kernel(tmp_path):
    with pytest.raises(ConfigError) as refused:
        run_job(
            compose(
                [
                    "hardware=blackwell8",
                    "hardware.tensor_parallel_size=1",  # SmolLM2's 9 heads
                    "run.plan_only=true",
                    f"run.output_root={tmp_path}",
                ]
            )
        )
    assert refused.value.key == "hardware.vllm.attention_backend"
    assert "hardware.vllm.attention_backend=null" in refused.value.message


def test_every_server_gets_the_settings_and_the_draft_kernel_only_a_standard_draft(tmp_path):
    from runner.serving.vllm_server import engine_args
    from stages.evaluate.serving import server_args

    cfg = typed(compose(KIMI_BOX))
    args = engine_args(cfg, 4096)
    for flag, value in (
        ("--attention-backend", "TRITON_MLA"),
        ("--kv-cache-dtype", "fp8"),
        ("--compilation-config", json.dumps({"cudagraph_mode": "FULL_AND_PIECEWISE"})),
    ):
        assert args[args.index(flag) + 1] == value
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "config.json").write_text(json.dumps({"transformer_layer_config": {"hidden": 7}}))
    mla = tmp_path / "mla"
    mla.mkdir()
    (mla / "config.json").write_text(
        json.dumps({"transformer_layer_config": {"kv_lora_rank": 512}})
    )

    def spec(draft):
        a = server_args(cfg, draft)
        return json.loads(a[a.index("--speculative-config") + 1])

    assert spec(ours)["attention_backend"] == "TRITON_ATTN"
    assert spec(ours)["rejection_sample_method"] == "standard"
    assert "attention_backend" not in spec(mla)  # an MLA draft shares the target's TRITON_MLA


def test_the_installed_vllm_parses_the_target_flags():
    """vLLM's own argument parser (of this environment) takes the flags the box's preset makes."""
    from runner.integrations.versions import VLLM_DISTS, installed
    from runner.integrations.vllm import engine_args_problem
    from runner.serving.settings import target_flags

    _, have = installed(*VLLM_DISTS)
    flags = target_flags(typed(compose(KIMI_BOX)).hardware.vllm)
    assert engine_args_problem(flags, have) is None
    # (Its parser takes any backend name: the plan's own check of the names is what refuses.)


def test_the_cards_serve_command_carries_the_settings_it_was_measured_with():
    from runner.commands.publish import model_card

    params = {
        "model.name": "kimi-k2.5",
        "model.hub_id": "moonshotai/Kimi-K2.5",
        "eval.num_speculative_tokens": "3",
        "hardware.vllm.attention_backend": "TRITON_MLA",
        "hardware.vllm.draft_attention_backend": "TRITON_ATTN",
        "hardware.vllm.kv_cache_dtype": "fp8",
        "hardware.vllm.rejection_sample_method": "None",
        "hardware.vllm.cudagraph_mode": "None",
    }
    run = SimpleNamespace(
        data=SimpleNamespace(params=params, tags={}), info=SimpleNamespace(run_id="r1")
    )
    card = model_card(run, {}, "me/draft", results=[{"set": "mtbench", "acceptance_length": 2.0}])
    line = next(ln for ln in card.splitlines() if ln.startswith("vllm serve"))
    words = shlex.split(line)
    assert words[words.index("--attention-backend") + 1] == "TRITON_MLA"
    assert words[words.index("--kv-cache-dtype") + 1] == "fp8"
    spec = json.loads(words[words.index("--speculative-config") + 1])
    assert spec["attention_backend"] == "TRITON_ATTN" and "rejection_sample_method" not in spec
