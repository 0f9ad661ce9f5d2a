"""The serving settings (hardware.vllm.attention_backend, draft_attention_backend,
kv_cache_dtype, rejection_sample_method, cudagraph_mode): the 8x RTX PRO 6000 preset serves Kimi
as the field does, every server the runner starts gets them, the card's serve command carries
them, and the plan refuses what would serve a draft at zero acceptance or not at all, in
seconds, naming the key."""

from __future__ import annotations

import json
import shlex
from types import SimpleNamespace
from typing import Any

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


# The same settings written as vLLM flags in extra_args, as the variable older vLLMs read, or
# with the card's name as nvidia-smi prints it: each reaches the same check.
SILENT = ["hardware.vllm.attention_backend=null", "hardware.vllm.kv_cache_dtype=null"]


@pytest.mark.parametrize(
    "overrides,key",
    [
        (
            [*SILENT, "hardware.vllm.extra_args=[--attention-backend,FLASHINFER_MLA,"
             "--kv-cache-dtype,fp8]"],
            "hardware.vllm.attention_backend",
        ),
        (
            [*SILENT, "hardware.vllm.attention_backend=FLASHINFER_MLA",
             "hardware.vllm.extra_args=['--kv_cache_dtype=fp8']"],
            "hardware.vllm.attention_backend",
        ),
        (
            [*SILENT, "+hardware.vllm.env.VLLM_ATTENTION_BACKEND=FLASHINFER_MLA",
             "hardware.vllm.kv_cache_dtype=fp8_e4m3"],
            "hardware.vllm.attention_backend",
        ),
        (
            ["hardware.vllm.attention_backend=FLASHINFER_MLA",
             "hardware.gpu_kind='NVIDIA RTX PRO 6000 Blackwell Server Edition'"],
            "hardware.vllm.attention_backend",
        ),
        (
            ["hardware.vllm.attention_backend=FLASHINFER_MLA", "hardware.gpu_kind='Mystery 9000'"],
            "hardware.compute_capability",
        ),
        # Written twice with two values: which one would the server get?
        (["hardware.vllm.extra_args=['--attention-backend=FLASHINFER_MLA']"],
         "hardware.vllm.attention_backend"),
        (["hardware.vllm.extra_args=[-cc.cudagraph_mode,NONE]"], "hardware.vllm.cudagraph_mode"),
        (["hardware.vllm.extra_args=[--speculative-config,"
          "'{\"attention_backend\": \"FLASH_ATTN\"}']"],
         "hardware.vllm.draft_attention_backend"),
        (["hardware.vllm.extra_args=[--kv-cache-dtype]"], "hardware.vllm.extra_args"),
    ],
)  # fmt: skip
def test_a_serving_setting_is_checked_however_it_is_written(tmp_path, overrides, key):
    with pytest.raises(ConfigError) as refused:
        plan(tmp_path, *overrides)
    assert refused.value.key == key, refused.value
    if key == "hardware.vllm.attention_backend" and "one place" not in refused.value.message:
        assert "zero acceptance" in refused.value.message


def test_flags_in_extra_args_become_the_typed_settings_and_reach_the_server_once():
    from runner.serving.vllm_server import command_line, engine_args

    cfg = typed(
        compose(
            [
                *KIMI_BOX,
                *SILENT,
                "hardware.vllm.cudagraph_mode=null",
                "hardware.vllm.extra_args=[--max-num-seqs,'8','--kv-cache-dtype=fp8',"
                "--attention_backend,TRITON_MLA,--compilation-config,"
                '\'{"cudagraph_mode": "PIECEWISE", "level": 3}\']',
            ]
        )
    )
    v = cfg.hardware.vllm
    assert (v.attention_backend, v.kv_cache_dtype, v.cudagraph_mode) == (
        "TRITON_MLA",
        "fp8",
        "PIECEWISE",
    )
    args = command_line(cfg, "target", engine_args(cfg, 4096), 8000)
    assert args.count("--attention-backend") == args.count("--kv-cache-dtype") == 1
    assert args.count("--compilation-config") == 1
    config = json.loads(args[args.index("--compilation-config") + 1])
    assert config == {"level": 3, "cudagraph_mode": "PIECEWISE"}
    assert v.extra_args[:2] == ["--max-num-seqs", "8"]


def test_nvidia_smi_names_map_to_their_compute_capability():
    from runner.serving.settings import capability_of

    assert capability_of("NVIDIA RTX PRO 6000 Blackwell Server Edition") == "12.0"
    assert capability_of("NVIDIA GeForce RTX 5090") == "12.0"
    assert capability_of("NVIDIA H100 80GB HBM3") == "9.0"
    assert capability_of("NVIDIA A100-SXM4-80GB") == "8.0"
    assert capability_of("NVIDIA GB200") == "10.0" and capability_of("B200") == "10.0"
    assert capability_of("NVIDIA RTX 6000 Ada Generation") is None  # not the PRO 6000


def test_an_fp8_kv_cache_on_a_cpu_without_avx512_is_refused_in_the_plan(tmp_path, monkeypatch):
    import runner.serving.settings as settings

    monkeypatch.setattr(settings, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    with pytest.raises(ConfigError) as refused:
        run_job(
            compose(
                [
                    "hardware.vllm.kv_cache_dtype=fp8_e5m2",
                    "run.plan_only=true",
                    f"run.output_root={tmp_path}",
                ]
            )
        )
    assert refused.value.key == "hardware.vllm.kv_cache_dtype"
    assert "AVX-512" in refused.value.message


def test_every_flag_and_variable_a_server_gets_is_part_of_its_stages_keys(tmp_path):
    """A stored extraction, regeneration or evaluation is reused only for the servers it was
    measured on: another flag in extra_args, a serving setting written as a flag, or another
    variable in hardware.env or hardware.vllm.env is another key; a variable that only says how
    much to log or where threads run is not."""
    from stages import REGISTRY

    base = ["extract=vllm", "regenerate=vllm", "run.plan_only=true", f"run.output_root={tmp_path}"]
    facts = run_job(compose(base)).target.facts
    stages = {s.name: s for s in REGISTRY if s.name in ("extract", "regenerate", "evaluate")}

    def keys(*overrides: str) -> dict[str, Any]:
        cfg = typed(compose([*base, *overrides]))
        return {name: s.key_config(cfg, facts) for name, s in stages.items()}

    before = keys()
    for change in (
        "hardware.vllm.extra_args=[--max-num-seqs,'4']",
        "hardware.vllm.extra_args=[--kv-cache-dtype,bfloat16]",
        "+hardware.vllm.env.VLLM_USE_V2_MODEL_RUNNER=1",
        "+hardware.env.VLLM_FLOAT32_MATMUL_PRECISION=high",
    ):
        after = keys(change)
        assert all(after[n] != before[n] for n in stages), change
    train = next(s for s in REGISTRY if s.name == "train")
    changed = typed(compose([*base, "+hardware.env.NCCL_ALGO=Ring"]))
    assert train.key_config(changed, facts) != train.key_config(typed(compose(base)), facts)
    for harmless in (
        "+hardware.env.NCCL_DEBUG=INFO",
        "+hardware.vllm.env.VLLM_CPU_KVCACHE_SPACE=1",
    ):
        assert keys(harmless) == before, harmless
