"""The number format a run computes in: `hardware.dtype: auto` resolved for this machine.

    choice = choose_dtype("cpu", cpu_flags(), platform.machine(), os.environ)
    choice.dtype, choice.reason      # "float32", "AVX2, no native bf16"

A GPU computes in bfloat16. A CPU computes in bfloat16 only where it multiplies bf16 matrices
natively: x86 with AMX (`amx_bf16`) or AVX-512 BF16 (`avx512_bf16`), Arm with the BF16
extension (`bf16` among /proc/cpuinfo's Features). Elsewhere torch's CPU build emulates bf16
products, and float32 is far faster: on an AMD EPYC of the Zen 3 generation (AVX2, 2 threads,
torch 2.13, 2026-12-07) a 512x576 by 576x1536 product ran at 1.2 GFLOP/s in bf16 and 132
GFLOP/s in float32.

oneDNN, which multiplies torch's bf16 matrices on x86, and ATen's own kernels can be held below
the CPU's instruction set (`ONEDNN_MAX_CPU_ISA=AVX2`, `ATEN_CPU_CAPABILITY=avx2`): a CPU held so
counts as one without native bf16, as it computes.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# x86 flags of native bf16 matrix products, the strongest first.
_X86_BF16 = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 BF16"))
# oneDNN's ISA caps that leave out its bf16 kernels (oneDNN's names; AVX512_CORE_BF16,
# AVX512_CORE_AMX and ALL keep them).
_ONEDNN_NO_BF16 = {
    "SSE41",
    "AVX",
    "AVX2",
    "AVX2_VNNI",
    "AVX2_VNNI_2",
    "AVX512_CORE",
    "AVX512_CORE_VNNI",
}
# ATEN_CPU_CAPABILITY values below AVX-512.
_ATEN_NO_BF16 = {"default", "avx2"}


@dataclass(frozen=True)
class FormatChoice:
    """The format `hardware.dtype: auto` takes here, and why (printed in the plan)."""

    dtype: str
    reason: str


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags: x86's `flags` and Arm's `Features` lines of /proc/cpuinfo (or
    of `cpuinfo`, its text); empty where it cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    found: set[str] = set()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip().lower() in ("flags", "features"):
            found.update(value.split())
    return frozenset(found)


def _held_below_bf16(env: Mapping[str, str]) -> str | None:
    isa = env.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if isa in _ONEDNN_NO_BF16:
        return f"ONEDNN_MAX_CPU_ISA={isa}"
    cap = env.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if cap in _ATEN_NO_BF16:
        return f"ATEN_CPU_CAPABILITY={cap}"
    return None


def native_bf16(flags: frozenset[str], machine: str) -> str | None:
    """The CPU's native bf16 matrix unit ("AMX", "AVX-512 BF16", "Arm BF16"), else None."""
    if machine.lower() in ("aarch64", "arm64"):
        return "Arm BF16" if "bf16" in flags else None
    for flag, name in _X86_BF16:
        if flag in flags:
            return name
    return None


def _vector_unit(flags: frozenset[str], machine: str) -> str:
    if machine.lower() in ("aarch64", "arm64"):
        return "Arm without BF16"
    for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX")):
        if flag in flags:
            return name
    return machine or "this CPU"


def choose_dtype(
    device: str,
    flags: frozenset[str] | None = None,
    machine: str | None = None,
    env: Mapping[str, str] | None = None,
) -> FormatChoice:
    """What `hardware.dtype: auto` means on `device` with these CPU flags (default: this
    machine's), machine (`uname -m`) and environment."""
    if device != "cpu":
        return FormatChoice("bfloat16", "a GPU")
    flags = cpu_flags() if flags is None else flags
    machine = platform.machine() if machine is None else machine
    unit = native_bf16(flags, machine)
    if unit is None:
        return FormatChoice("float32", f"{_vector_unit(flags, machine)}, no native bf16")
    held = _held_below_bf16(os.environ if env is None else env)
    if held:
        return FormatChoice("float32", f"{unit} held back by {held}, no native bf16")
    return FormatChoice("bfloat16", f"{unit}, native bf16")


def describe(device: str, dtype: str) -> str:
    """The plan's line for the format in use: "float32 (AVX2, no native bf16)", or, where
    hardware.dtype set another, that and this machine's own."""
    choice = choose_dtype(device)
    if dtype == choice.dtype:
        return f"{dtype} ({choice.reason})"
    return f"{dtype} (hardware.dtype; this machine's own: {choice.dtype}, {choice.reason})"
