"""The serving settings of `hardware.vllm` (attention_backend, draft_attention_backend,
kv_cache_dtype, rejection_sample_method, cudagraph_mode): the flags and speculative-config
fields they become, and the plan's checks of them.

    target_flags(cfg.hardware.vllm)            # ["--attention-backend", "TRITON_MLA", ...]
    draft_fields(cfg.hardware.vllm, mla=False) # {"attention_backend": "TRITON_ATTN", ...}
    problems(hw, target_mla=True, names=...)   # [(key, why), ...] for the plan to refuse

Why they are checked: on compute capability 12.x (RTX PRO 6000, RTX 5090) an MLA target served
with FLASHINFER_MLA and an fp8 KV cache accepts no drafted token at all, with no error, while it
still answers fast enough to look like a speed-up (vLLM #40608); TRITON_MLA works. A kernel for
the wrong attention kind, or one the CPU build lacks, fails only once the server builds the
model, which on a 1T-parameter target is many minutes after launch.
"""

from __future__ import annotations

import difflib
import json
import re
from typing import Any

from runner.core.hardware_settings import HardwareConfig, VllmLaunchConfig
from runner.core.number_format import cpu_flags
from runner.core.serving_flags import carries_compilation_config

# vLLM 0.32.0's names (AttentionBackendEnum, CacheDType, CUDAGraphMode): checked against when the
# installed vLLM cannot be asked (another vLLM through hardware.vllm.command, or none here).
BACKENDS = (
    "FLASH_ATTN", "FLASH_ATTN_DIFFKV", "TRITON_ATTN", "TRITON_ATTN_DIFFKV", "TRITON_FLASH_ATTN",
    "ROCM_ATTN", "ROCM_SEGMENTED_ATTN", "ROCM_AITER_MLA", "ROCM_AITER_TRITON_MLA",
    "ROCM_AITER_FA", "ROCM_AITER_MLA_SPARSE", "XPU_MLA_SPARSE", "FLASHINFER",
    "TRITON_FLASHINFER", "FLASHINFER_MLA", "TOKENSPEED_MLA", "FLASHINFER_MLA_SPARSE",
    "FLASHINFER_MLA_SPARSE_SM120", "FLASHINFER_MLA_SPARSE_SM90", "TRITON_MLA", "CUTLASS_MLA",
    "FLASHMLA", "FLASHMLA_SPARSE", "B12X", "FLASH_ATTN_MLA", "FLASH_ATTN_MLA_SPARSE",
    "FLEX_ATTENTION", "ROCM_AITER_UNIFIED_ATTN", "CPU_ATTN", "CPU_MLA", "AMX_MLA",
)  # fmt: skip
KV_CACHE_DTYPES = (
    "auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
    "nvfp4_ds_mla", "nvfp4",
)  # fmt: skip
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
# 'synthetic' accepts drafted tokens at rates set by hand: a simulation, not a measurement.
REJECTION_METHODS = ("standard", "block")
# The CPU build's own kernels; every other backend needs a GPU.
CPU_BACKENDS = ("CPU_ATTN", "CPU_MLA", "AMX_MLA")
# Known to give zero acceptance, with no error, on these compute capabilities with a quantized
# KV cache: (backend, major capability).
SILENT_ZERO = (("FLASHINFER_MLA", 12),)
# hardware.gpu_kind -> compute capability, for GPUs named in the hardware presets and rates.
CAPABILITY = {
    "RTX PRO 6000": "12.0",
    "RTX 5090": "12.0",
    "B200": "10.0",
    "GB200": "10.0",
    "B300": "10.3",
    "H200": "9.0",
    "H100": "9.0",
    "H20": "9.0",
    "L40S": "8.9",
    "A100": "8.0",
}


def is_mla(backend: str) -> bool:
    return "MLA" in backend


def target_flags(v: VllmLaunchConfig) -> list[str]:
    """The server flags of the target's settings (none for those left to vLLM)."""
    flags = []
    if v.attention_backend:
        flags += ["--attention-backend", v.attention_backend]
    if v.kv_cache_dtype:
        flags += ["--kv-cache-dtype", v.kv_cache_dtype]
    if v.cudagraph_mode and not carries_compilation_config(v.extra_args):
        # (a compilation config in extra_args carries the mode itself: serving_flags.fold)
        flags += ["--compilation-config", json.dumps({"cudagraph_mode": v.cudagraph_mode})]
    return flags


def draft_fields(v: VllmLaunchConfig, mla: bool) -> dict[str, Any]:
    """Speculative-config fields of the draft's settings. A draft with MLA attention shares the
    target's kernel (vLLM's default for the draft), so draft_attention_backend, which names a
    standard-attention kernel, applies only to a draft without MLA."""
    fields: dict[str, Any] = {}
    if v.draft_attention_backend and not mla:
        fields["attention_backend"] = v.draft_attention_backend
    if v.rejection_sample_method:
        fields["rejection_sample_method"] = v.rejection_sample_method
    return fields


def _words(name: str) -> str:
    """'NVIDIA GeForce RTX 5090' -> ' RTX 5090 ': upper case, dashes and underscores as
    spaces, the maker's words dropped, padded for whole-word matches."""
    text = re.sub(r"[-_/]", " ", name.upper())
    text = re.sub(r"\b(NVIDIA|GEFORCE|TESLA)\b", " ", text)
    return f" {' '.join(text.split())} "


def capability_of(gpu_kind: str | None) -> str | None:
    """The compute capability of a card named as the presets name it ("RTX PRO 6000") or as
    `nvidia-smi` prints it ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "NVIDIA
    H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"): the longest known name among its words."""
    words = _words(gpu_kind or "")
    found = [name for name in CAPABILITY if _words(name) in words]
    return CAPABILITY[max(found, key=len)] if found else None


def capability(hw: HardwareConfig) -> str | None:
    """hardware.compute_capability, else what hardware.gpu_kind is known to have."""
    return hw.compute_capability or capability_of(hw.gpu_kind)


def _unknown(key: str, value: str, known: list[str] | tuple[str, ...]) -> tuple[str, str]:
    near = difflib.get_close_matches(value, known, n=1)
    hint = f"; did you mean {near[0]}?" if near else f"; one of {', '.join(known)}"
    return key, f"{value!r} is not a name vLLM knows{hint}"


def _unknown_names(v: Any, names: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, why) for each serving setting whose value the installed vLLM does not know (its
    `names`, else vLLM 0.32.0's), and for rejection sampling that measures nothing."""
    backends = names.get("backends") or BACKENDS
    found = []
    for key, value, known in (
        ("attention_backend", v.attention_backend, backends),
        ("draft_attention_backend", v.draft_attention_backend, backends),
        ("kv_cache_dtype", v.kv_cache_dtype, names.get("kv_cache_dtypes") or KV_CACHE_DTYPES),
        ("cudagraph_mode", v.cudagraph_mode, names.get("cudagraph_modes") or CUDAGRAPH_MODES),
        ("rejection_sample_method", v.rejection_sample_method, REJECTION_METHODS),
    ):
        if value is not None and value not in known:
            if key == "rejection_sample_method" and value == "synthetic":
                found.append(
                    (
                        f"hardware.vllm.{key}",
                        "'synthetic' accepts drafted tokens at rates set by hand: the acceptance "
                        "it reports is not the draft's; use standard or block",
                    )
                )
            else:
                found.append(_unknown(f"hardware.vllm.{key}", value, known))
    return found


def problems(
    hw: HardwareConfig,
    target_mla: bool,
    names: dict[str, Any] | None = None,
    draft_served: bool = True,
) -> list[tuple[str, str]]:
    """(key, why) for each serving setting the run cannot use: unknown names (from the installed
    vLLM's `names`, else vLLM 0.32.0's), a kernel of the wrong attention kind, a GPU kernel on the
    CPU, the silent zero of SILENT_ZERO, and rejection sampling that measures nothing."""
    v = hw.vllm
    found = _unknown_names(v, names or {})
    if found:
        return found
    on_cpu = hw.device == "cpu"
    for key, value in (
        ("attention_backend", v.attention_backend),
        ("draft_attention_backend", v.draft_attention_backend),
    ):
        if value and on_cpu and value not in CPU_BACKENDS:
            found.append(
                (
                    f"hardware.vllm.{key}",
                    f"{value} is a GPU kernel and hardware.device is cpu; vLLM's CPU build runs "
                    f"{' or '.join(CPU_BACKENDS)} (or leave it null)",
                )
            )
        elif value and not on_cpu and value in CPU_BACKENDS:
            found.append((f"hardware.vllm.{key}", f"{value} is a CPU kernel; this run is on GPUs"))
    quantized = (v.kv_cache_dtype or "auto").startswith(("fp8", "nvfp4"))
    if on_cpu and quantized and not _cpu_fp8(v.kv_cache_dtype or ""):
        found.append(
            (
                "hardware.vllm.kv_cache_dtype",
                f"{v.kv_cache_dtype}: vLLM's CPU build keeps an fp8 KV cache only on x86 with "
                "AVX-512 or AMX, and nvfp4 never; this CPU has neither. Set auto (or null)",
            )
        )
    if v.cudagraph_mode not in (None, "NONE") and on_cpu:
        found.append(
            (
                "hardware.vllm.cudagraph_mode",
                f"{v.cudagraph_mode}: CUDA graphs need a GPU (the CPU build runs eager); set null",
            )
        )
    if v.attention_backend and is_mla(v.attention_backend) != target_mla:
        kind = "MLA" if target_mla else "standard attention"
        found.append(
            (
                "hardware.vllm.attention_backend",
                f"{v.attention_backend} is {'an MLA' if is_mla(v.attention_backend) else 'a'} "
                f"kernel{'' if is_mla(v.attention_backend) else ' for standard attention'}, but "
                f"the target uses {kind}: vLLM would refuse it while building the model. "
                + (
                    "Use an MLA kernel (TRITON_MLA works everywhere) or null"
                    if target_mla
                    else "Set it null (or FLASH_ATTN, TRITON_ATTN, FLASHINFER), e.g. "
                    "hardware.vllm.attention_backend=null"
                ),
            )
        )
    if draft_served and v.draft_attention_backend and is_mla(v.draft_attention_backend):
        found.append(
            (
                "hardware.vllm.draft_attention_backend",
                f"{v.draft_attention_backend} is an MLA kernel; this setting is the kernel of a "
                "draft with standard attention (what this runner trains; an MLA draft shares "
                "hardware.vllm.attention_backend). Use TRITON_ATTN, FLASH_ATTN or FLASHINFER",
            )
        )
    found += silent_zero(hw)
    return found


def _cpu_fp8(kv_cache_dtype: str) -> bool:
    """Whether vLLM's CPU build can keep this quantized KV cache on this CPU (x86 with AVX-512
    or AMX; never nvfp4)."""
    flags = cpu_flags()
    return kv_cache_dtype.startswith("fp8") and any(f.startswith(("avx512f", "amx")) for f in flags)


def silent_zero(hw: HardwareConfig) -> list[tuple[str, str]]:
    """The combination known to serve a draft with zero acceptance and no error; a card whose
    capability is not known when that combination is asked for."""
    v = hw.vllm
    cc = capability(hw)
    quantized = (v.kv_cache_dtype or "auto").startswith(("fp8", "nvfp4"))
    if not (quantized and v.attention_backend):
        return []
    risky = any(v.attention_backend == backend for backend, _ in SILENT_ZERO)
    if cc is None and risky and hw.device == "cuda":
        return [
            (
                "hardware.compute_capability",
                f"{v.attention_backend} with KV cache dtype {v.kv_cache_dtype} gives zero "
                "acceptance on some GPUs, and hardware.gpu_kind "
                f"({hw.gpu_kind or 'unset'}) is not a card the runner knows; set "
                "hardware.compute_capability (`nvidia-smi --query-gpu=compute_cap "
                "--format=csv`)",
            )
        ]
    if cc is None:
        return []
    major = int(cc.split(".")[0])
    for backend, bad_major in SILENT_ZERO:
        if v.attention_backend == backend and major == bad_major:
            return [
                (
                    "hardware.vllm.attention_backend",
                    f"{backend} with KV cache dtype {v.kv_cache_dtype} on compute capability {cc} "
                    f"({hw.gpu_kind or 'hardware.compute_capability'}) serves an EAGLE-3 draft "
                    "with zero acceptance and no error (vLLM #40608); use TRITON_MLA, or "
                    "hardware.vllm.kv_cache_dtype=auto",
                )
            ]
    return []


def unset_warning(hw: HardwareConfig, target_mla: bool) -> str | None:
    """Why leaving the MLA kernel to vLLM is a risk on this box (None where it is not)."""
    v = hw.vllm
    cc = capability(hw)
    quantized = (v.kv_cache_dtype or "auto").startswith(("fp8", "nvfp4"))
    if target_mla and quantized and not v.attention_backend and cc and cc.startswith("12."):
        return (
            f"null: vLLM picks the MLA kernel, and on compute capability {cc} with KV cache dtype "
            f"{v.kv_cache_dtype} FLASHINFER_MLA gives zero acceptance with no error; "
            "set TRITON_MLA"
        )
    return None
