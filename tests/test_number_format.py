"""`hardware.dtype: auto` (runner/core/number_format.py): bf16 only where the CPU multiplies it
natively, float32 elsewhere, bf16 on a GPU; an explicit setting wins; the typed config carries
the resolved format to every stage."""

from __future__ import annotations

import pytest

from runner.core.number_format import choose_dtype, cpu_flags
from runner.core.schema import typed
from tests.conftest import compose

# /proc/cpuinfo excerpts of the CPU classes (flags abridged).
INTEL_AMX = "processor : 0\nflags : fpu sse avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ZEN4 = "processor : 0\nflags : fpu sse avx avx2 avx512f avx512bw avx512_bf16\n"
ZEN3 = "processor : 0\nflags : fpu sse avx avx2 fma\n"
ARM_BF16 = "processor : 0\nFeatures : fp asimd sve bf16 i8mm\n"
ARM = "processor : 0\nFeatures : fp asimd evtstrm crc32\n"


@pytest.mark.parametrize(
    ("cpuinfo", "machine", "dtype", "why"),
    [
        (INTEL_AMX, "x86_64", "bfloat16", "AMX, native bf16"),
        (ZEN4, "x86_64", "bfloat16", "AVX-512 BF16, native bf16"),
        (ZEN3, "x86_64", "float32", "AVX2, no native bf16"),
        (ARM_BF16, "aarch64", "bfloat16", "Arm BF16, native bf16"),
        (ARM, "aarch64", "float32", "Arm without BF16, no native bf16"),
    ],
)
def test_the_format_follows_the_cpus_matrix_units(cpuinfo, machine, dtype, why):
    choice = choose_dtype("cpu", cpu_flags(cpuinfo), machine, env={})
    assert (choice.dtype, choice.reason) == (dtype, why)


@pytest.mark.parametrize("env", [{"ONEDNN_MAX_CPU_ISA": "AVX2"}, {"ATEN_CPU_CAPABILITY": "avx2"}])
def test_a_cpu_held_to_avx2_counts_as_one_without_bf16(env):
    choice = choose_dtype("cpu", cpu_flags(ZEN4), "x86_64", env=env)
    assert choice.dtype == "float32"
    assert "held back by" in choice.reason and next(iter(env)) in choice.reason
    assert (
        choose_dtype("cpu", cpu_flags(ZEN4), "x86_64", env={"ONEDNN_MAX_CPU_ISA": "ALL"}).dtype
        == "bfloat16"
    )


def test_a_gpu_keeps_bf16_whatever_the_host_cpu():
    assert choose_dtype("cuda", cpu_flags(ZEN3), "x86_64", env={}).dtype == "bfloat16"


def test_the_typed_config_holds_the_resolved_format_and_an_explicit_one_wins():
    here = choose_dtype("cpu").dtype
    assert typed(compose([])).hardware.dtype == here
    assert typed(compose(["hardware.dtype=float32"])).hardware.dtype == "float32"
    assert typed(compose(["hardware.dtype=bfloat16"])).hardware.dtype == "bfloat16"
    assert typed(compose(["hardware=gpu1"])).hardware.dtype == "bfloat16"
