"""Preflight: the run's plan, from config files and this machine, before any weight loads.

`python -m runner model=kimi_k25 hardware=blackwell8 run.plan_only=true` prints it and stops
(seconds, no GPU). A normal run prints it first and stops on its errors. By the time the plan is
built the config has passed every check of runner/engine/checks.py; what is added here depends on
this
machine: free disk (a stage's own plan lines), the installed vLLM and whether its class for the
target captures EAGLE-3 aux hidden states, and whether a GPU is present.

The plan shows the target and where its text model lives, the stages to run or reuse, capture
layers in both layer-id conventions, each stage's own lines (draft shape, hidden-state bytes,
teacher-logit memory, ...), weights per GPU, parallelism and the environment that will be set.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig

from runner.assets.target_facts import Target, weight_bytes
from runner.core.layer_ids import to_output_of
from runner.core.layout import RunLayout
from runner.core.number_format import describe
from runner.core.schema import RunnerConfig
from runner.core.store import ArtifactStore, fmt_bytes
from runner.engine import costs
from runner.engine.stage import DRAFT, EXTRACTION, GENERATE, Plan, PlanView, ServerNeed, Stage
from runner.integrations.versions import ABSENT, VLLM_DISTS, installed, version_tuple
from runner.integrations.vllm import (
    MIN_VLLM,
    MIN_VLLM_DEFAULT,
    engine_args_problem,
    known_limits,
    ledger,
    serving_facts,
    unchecked,
    vllm_eagle3_support,
)
from runner.serving import endpoint
from runner.serving.settings import capability, problems, unset_warning
from runner.tracking.runs import (
    check_store,
    registered_name,
    registry_name_problem,
    tracking_uri,
)

GiB = 1 << 30
# Above this share of a GPU taken by weights, the plan warns that little is left for KV cache.
WEIGHTS_WARN_GPU_SHARE = 0.8


def _target_lines(plan: Plan, cfg: RunnerConfig, target: Target) -> None:
    layout, facts = target.layout, target.facts
    n = facts.num_layers
    wrapper = ", wrapper" if layout.wrapper else ""
    plan.add("target", f"{cfg.model.source} ({layout.architecture}{wrapper})")
    plan.add(
        "text model",
        f"{layout.layers} x{n}, norm {layout.norm}, head {layout.lm_head} [{layout.source}]",
    )
    experts = (
        f", {layout.num_experts} experts top-{layout.experts_per_token}"
        if layout.num_experts
        else ""
    )
    plan.add(
        "shape",
        f"hidden {layout.hidden_size}, vocab {layout.vocab_size}, heads "
        f"{layout.num_attention_heads}/{layout.num_key_value_heads} kv, "
        f"{layout.text_params / 1e9:.1f}B params{experts}",
    )
    if target.remote_code_reasons:
        plan.add("remote code", "allowed: " + "; ".join(target.remote_code_reasons))
    plan.add("capture ids (vLLM)", f"{list(facts.aux_layers)} + {n} (final, pre-norm)")
    plan.add("capture (output-of)", f"{to_output_of(list(facts.capture_ids))}")


def _hardware_lines(plan: Plan, cfg: RunnerConfig, target: Target) -> None:
    hw = cfg.hardware
    tp = hw.tensor_parallel_size
    plan.add(
        "parallelism",
        f"device {hw.device}, {hw.num_gpus} GPU(s), TP {tp}, interconnect {hw.interconnect}",
    )
    plan.add("number format", describe(str(hw.device), str(hw.dtype)))
    w = weight_bytes(target.layout, target.config, cfg.model.weights_gib)
    if hw.dtype == "float32" and w.kind == "bf16":  # loaded in float32: twice the bytes
        w = dataclasses.replace(w, bytes=w.bytes * 2, kind="float32")
    per_gpu = w.bytes / tp
    plan.numbers.update(weight_bytes=w.bytes, weight_bytes_per_gpu=per_gpu)
    of_gpu = f" of {hw.gpu_memory_gib:g} GiB" if hw.gpu_memory_gib else ""
    plan.add(
        "weights",
        f"~{fmt_bytes(w.bytes)} ({w.kind}), ~{fmt_bytes(per_gpu)} per GPU at TP {tp}{of_gpu}",
    )
    if not w.certain:
        plan.warn("model.weights_gib", f"weights per GPU are a guess: {w.kind}")
        return
    # Weights that do not fit at all are refused by runner.engine.checks; here, the tight case.
    if hw.gpu_memory_gib and per_gpu > WEIGHTS_WARN_GPU_SHARE * hw.gpu_memory_gib * GiB:
        share = per_gpu / (hw.gpu_memory_gib * GiB)
        plan.warn(
            "hardware.gpu_memory_gib",
            f"weights take {share:.0%} of each GPU: little room for KV cache",
        )


def _engine_lines(
    plan: Plan, cfg: RunnerConfig, target: Target, needs: dict[str, ServerNeed]
) -> None:
    """Every stage that starts a vLLM server needs it, and needs the target's vLLM class to
    capture EAGLE-3 aux hidden states: found out here, not after a half-hour load."""
    arch = target.layout.architecture
    need = MIN_VLLM.get(arch, MIN_VLLM_DEFAULT)
    custom = list(cfg.hardware.vllm.command)
    users = list(needs)
    started_by = ", ".join(users) or "no stage of this run"
    if custom:
        plan.add(
            "vLLM",
            f"launched as {' '.join(custom)} (hardware.vllm.command): version and model class "
            f"not checked here; {arch} needs >= {need}",
        )
        return
    dist, have = installed(*VLLM_DISTS)
    plan.add(
        "vLLM",
        f"installed {'none' if have == ABSENT else f'{dist} {have}'}; {arch} needs >= {need} "
        f"for EAGLE-3 extraction and serving; started by {started_by}",
    )
    if not users:
        return
    who = " and ".join(users)
    if have == ABSENT:
        plan.error(
            "run.stages",
            f"{who} need vLLM, which is not installed (make setup installs it); or drop them "
            "from run.stages / use extract.backend=transformers",
        )
        return
    if version_tuple(have) < version_tuple(need):
        plan.error("run.stages", f"vLLM {have} is older than {need}, which {arch} needs")
        return
    why = unchecked(dist, have)
    if why and not cfg.hardware.vllm.allow_unchecked_version:
        plan.error(
            "hardware.vllm.allow_unchecked_version",
            f"{why}: install a checked one (`make setup`; on a GPU machine `pip install '.[gpu]' "
            "-c constraints/h200-py312-cu130.txt`), or set it true to run this one at your own "
            "risk",
        )
        return
    if why:
        plan.warn("hardware.vllm.allow_unchecked_version", f"{why}; running it as asked")
    extra = list(cfg.hardware.vllm.extra_args)
    refused = engine_args_problem(extra, have) if extra and not cfg.hardware.vllm.endpoint else None
    if refused:
        plan.error("hardware.vllm.extra_args", f"vLLM {have}'s own parser refuses them: {refused}")
    support = vllm_eagle3_support(arch, have)
    extracting = [n for n in needs.values() if n.kind == EXTRACTION]
    if support is None:
        plan.warn("run.stages", f"could not ask vLLM {have} whether {arch} supports EAGLE-3")
    elif not support["known"]:
        plan.error(
            "model.architecture",
            f"vLLM {have} has no model class for {arch}; {who} cannot serve it",
        )
    elif not support["eagle3"]:
        plan.error(
            "model.architecture",
            f"vLLM {have}'s {support['cls']} does not implement SupportsEagle3 (no EAGLE-3 aux "
            f"hidden states), so {who} cannot capture or serve with a draft; use a target class "
            "that does, or another vLLM (hardware.vllm.command)",
        )
    elif extracting and not support.get("extract_hidden_states"):
        plan.error(
            extracting[0].key,
            f"vLLM {have} lacks the extract_hidden_states speculative method or its "
            "hidden-states connector; use extract=transformers or a newer vLLM",
        )
    else:
        plan.add("vLLM class", f"{support['cls']}: SupportsEagle3")


def _engine_limits(
    plan: Plan, cfg: RunnerConfig, target: Target, needs: dict[str, ServerNeed]
) -> None:
    """What the installed vLLM cannot do with this target, found by running the Kimi-K2.5
    miniature (runner/assets/miniatures.py) through it, refused before anything loads."""
    if not needs:
        return
    text = target.config.get("text_config") or target.config
    drafts = [name for name, need in needs.items() if need.kind == DRAFT]
    on_cpu = cfg.hardware.device == "cpu" and not cfg.hardware.vllm.endpoint
    for key, message in known_limits(text, target.facts.extract_ids, drafts, on_cpu):
        plan.error(key, message)


def _serving_lines(
    plan: Plan, cfg: RunnerConfig, target: Target, needs: dict[str, ServerNeed]
) -> None:
    """The serving settings (hardware.vllm.attention_backend and its kin): what they are, what
    the installed vLLM has of the fixes the field needed, and a refusal of what cannot work."""
    v = cfg.hardware.vllm
    set_ = v.serving()
    if not needs:
        return
    text = target.config.get("text_config") or target.config
    mla = bool(text.get("kv_lora_rank"))
    shown = ", ".join(f"{k} {val}" for k, val in set_.items()) or "vLLM's own choices"
    plan.add("serving", f"{shown} ({'MLA' if mla else 'standard attention'} target)")
    if v.endpoint:
        if set_:
            plan.warn(
                "hardware.vllm.endpoint",
                f"the server there was started by someone else: {', '.join(set_)} are not "
                "applied to it; start it with the same settings",
            )
        return
    facts = None
    # Asking vLLM takes seconds the first time: only where a GPU serves or a setting is set.
    if not v.command and (set_ or cfg.hardware.device == "cuda"):
        dist, have = installed(*VLLM_DISTS)
        if have != ABSENT:
            facts = serving_facts(have)
            has = ledger(facts)
            words = {True: "has", False: "lacks", None: "cannot tell"}
            parts = [
                f"{words[ok]} " + ", ".join(n for n, o in has if o is ok)
                for ok in (True, False, None)
                if any(o is ok for _, o in has)
            ]
            plan.add(
                "vLLM fixes",
                f"{dist} {have} " + "; ".join(parts) + " (runner/integrations/vllm.py LEDGER)",
            )
            cc = capability(cfg.hardware)
            if (
                v.attention_backend == "FLASHINFER_MLA"
                and cc
                and cc.startswith("12.")
                and (facts or {}).get("flashinfer_mla_sm12x") is False
            ):
                plan.error(
                    "hardware.vllm.attention_backend",
                    f"vLLM {have}'s FLASHINFER_MLA does not run on compute capability {cc}; "
                    "use TRITON_MLA",
                )
            fields = (facts or {}).get("speculative_fields")
            for key in ("attention_backend", "rejection_sample_method"):
                ours = "draft_attention_backend" if key == "attention_backend" else key
                if getattr(v, ours) and fields is not None and key not in fields:
                    plan.error(
                        f"hardware.vllm.{ours}",
                        f"vLLM {have}'s speculative config has no {key}; leave it null or use a "
                        "vLLM that has it",
                    )
    drafts = any(n.kind == DRAFT for n in needs.values())
    for key, why in problems(cfg.hardware, mla, facts, draft_served=drafts):
        plan.error(key, why)
    if why := unset_warning(cfg.hardware, mla):
        plan.warn("hardware.vllm.attention_backend", why)


def _probe_tokens(cfg: RunnerConfig, target: Target) -> list[int] | None:
    """The configured target's ids for the endpoint probe text (None if its tokenizer does not
    load here: then the tokenizers are not compared)."""
    try:
        from transformers import AutoTokenizer  # seconds; only a run with an endpoint asks

        tok = AutoTokenizer.from_pretrained(
            target.facts.path, trust_remote_code=cfg.model.trust_remote_code
        )
        return list(tok.encode(endpoint.PROBE_TEXT, add_special_tokens=False))
    except Exception:
        return None


def _endpoint_lines(
    plan: Plan, cfg: RunnerConfig, target: Target, needs: dict[str, ServerNeed]
) -> None:
    """hardware.vllm.endpoint: a server that already runs, asked now whether it is the one the
    stages of this run need (runner/serving/endpoint.py)."""
    url = cfg.hardware.vllm.endpoint
    assert url is not None
    if not needs:
        plan.add("vLLM", f"{url} (hardware.vllm.endpoint): no stage of this run uses it")
        return
    kinds = {name: need.kind for name, need in needs.items()}
    if len(set(kinds.values())) > 1:
        plan.error(
            "hardware.vllm.endpoint",
            f"one server serves one configuration, but {', '.join(kinds)} need both hidden-state "
            "extraction and a draft; run them in separate invocations (run.stages=[...])",
        )
        return
    _check_endpoint(
        plan, cfg, target, url, "hardware.vllm.endpoint", next(iter(needs.values())), list(kinds)
    )


def _check_endpoint(
    plan: Plan,
    cfg: RunnerConfig,
    target: Target,
    url: str,
    key: str,
    need: ServerNeed,
    users: list[str],
    down_is_error: bool = True,
) -> bool:
    """Ask the server at `url` (the setting `key`) whether it is the one `need` asks for; its
    problems go to the plan. Returns whether it answered."""
    info = endpoint.inspect(url, timeout=float(cfg.tracking.connect_timeout_s))
    if isinstance(info, str):
        if down_is_error:
            plan.error(key, f"{url} {info}")
        else:
            plan.warn(key, f"{url} {info}: left out unless it answers when the stage starts")
        return False
    plan.add("vLLM", f"existing server {endpoint.describe(info)}; used by {', '.join(users)}")
    found = endpoint.problems(
        info,
        endpoint.EXTRACTION if need.kind == EXTRACTION else endpoint.DRAFT,
        tokens=_probe_tokens(cfg, target),
        min_model_len=need.context,
        len_key=need.context_key,
        dtype=cfg.hardware.dtype,
        k=need.k,
        k_key=need.k_key or "k",
    )
    for level, k, message in found:
        (plan.error if level == "error" else plan.warn)(k, message)
    for note in info.notes:
        plan.warn(key, note)
    return True


def _endpoints_lines(
    plan: Plan, cfg: RunnerConfig, target: Target, needs: dict[str, ServerNeed]
) -> None:
    """hardware.vllm.endpoints: servers that already run, for offline extraction. Each is asked
    now; one that does not answer is only a warning (the others take its rows), none is an
    error."""
    urls = cfg.hardware.vllm.endpoints
    if not needs:
        plan.add(
            "vLLM", f"{len(urls)} servers (hardware.vllm.endpoints): no stage of this run uses them"
        )
        return
    need = next(iter(needs.values()))
    up = [
        _check_endpoint(
            plan, cfg, target, url, f"hardware.vllm.endpoints[{k}]", need, list(needs), False
        )
        for k, url in enumerate(urls)
    ]
    if not any(up):
        plan.error("hardware.vllm.endpoints", f"none of the {len(urls)} servers answers")
    else:
        plan.add(
            "vLLM",
            f"extraction shares its rows among {sum(up)} of {len(urls)} servers "
            "(hardware.vllm.endpoints); one that stops answering is left out",
        )


# Filesystems that one machine alone sees: a store there is not shared by a cluster's nodes.
LOCAL_FILESYSTEMS = ("ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs")


def filesystem_of(path: Path) -> str:
    """The type of the filesystem that holds `path` (Linux /proc/mounts), or "unknown"."""
    p = path.resolve()
    while not p.exists():
        p = p.parent
    best, kind = "", "unknown"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in mounts:
        parts = line.split()
        inside = len(parts) >= 3 and (str(p) + "/").startswith(parts[1].rstrip("/") + "/")
        if inside and len(parts[1]) >= len(best):
            best, kind = parts[1], parts[2]
    return kind


def _launcher_lines(plan: Plan, output_root: Path) -> None:
    """Jobs on other nodes (Slurm) share the store and its locks only on shared storage."""
    if not HydraConfig.initialized():
        return
    target = str(HydraConfig.get().launcher.get("_target_", ""))
    if "Slurm" not in target:
        return
    kind = filesystem_of(output_root)
    plan.add("launcher", f"Slurm (submitit); run.output_root on {kind}")
    if kind in LOCAL_FILESYSTEMS:
        plan.warn(
            "run.output_root",
            f"{output_root} is on a local {kind} filesystem: jobs on other nodes see neither its "
            "artifacts nor its locks; use shared storage (NFSv4, Lustre with -o flock, GPFS, "
            "BeeGFS, CephFS)",
        )


def build_plan(
    cfg: RunnerConfig,
    target: Target,
    planned: list[Any],
    missing: str | None,
    store: ArtifactStore,
    layout: RunLayout,
) -> Plan:
    """The plan for `planned` (runner.engine.pipeline.PlannedStage list); `missing` says why a
    needed
    stage can be neither reused nor computed."""
    plan = Plan()
    _target_lines(plan, cfg, target)
    plan.add("stages", ", ".join(f"{p.name}:{p.action}" for p in planned))
    for p in planned:
        if p.why and p.why != "nothing stored yet":
            plan.add(f"  {p.name} runs", p.why)
    if missing:
        plan.error("run.stages", missing)
    view = PlanView(
        cfg=cfg,
        target=target,
        store=store,
        output_root=layout.root,
        layout=layout,
        actions={p.name: p.action for p in planned},
        keys={p.name: p.key for p in planned},
    )
    stages: list[Stage] = [p.stage for p in planned]
    for stage in stages:
        if stage.plan is not None:
            stage.plan(plan, view)
    _hardware_lines(plan, cfg, target)
    # Only stages this invocation runs start servers.
    needs = {
        s.name: need
        for s in stages
        if s.server is not None
        and view.actions[s.name] == "run"
        and (need := s.server(cfg)) is not None
    }
    if cfg.hardware.vllm.endpoint:
        # A generating stage (regenerate) always starts a server of its own: the endpoint
        # serves the rest.
        _endpoint_lines(plan, cfg, target, {n: x for n, x in needs.items() if x.kind != GENERATE})
    elif cfg.hardware.vllm.endpoints:
        # Only offline extraction goes through several; the other stages start their own.
        _endpoints_lines(
            plan, cfg, target, {n: x for n, x in needs.items() if x.kind == EXTRACTION}
        )
        _engine_lines(plan, cfg, target, {n: x for n, x in needs.items() if x.kind != EXTRACTION})
    else:
        _engine_lines(plan, cfg, target, needs)
    _engine_limits(plan, cfg, target, needs)
    _serving_lines(plan, cfg, target, needs)
    costs.total_lines(plan, cfg)
    plan.add("environment", ", ".join(f"{k}={v}" for k, v in cfg.hardware.env.items()) or "(none)")
    _launcher_lines(plan, layout.root)
    _gpu_lines(plan, cfg, any(p.action == "run" for p in planned))
    _tracking_lines(plan, cfg, layout.root)
    return plan


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use, from the device nodes and CUDA_VISIBLE_DEVICES
    (without importing torch or initialising CUDA)."""
    nodes = [p for p in Path("/dev").glob("nvidia[0-9]*") if p.name[6:].isdigit()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return len(nodes)
    ids = [v for v in visible.split(",") if v.strip() and v.strip() != "-1"]
    return min(len(ids), len(nodes))


def _gpu_lines(plan: Plan, cfg: RunnerConfig, runs_stages: bool) -> None:
    """A GPU hardware config on a machine without (enough) GPUs is refused before anything
    loads; a stage never falls back to the CPU. A plan alone (run.plan_only) only warns: plans
    for the GPU box are made anywhere."""
    hw = cfg.hardware
    if hw.device != "cuda":
        return
    have = visible_gpus()
    if have >= hw.num_gpus:
        return
    what = "no NVIDIA GPU" if have == 0 else f"{have} visible NVIDIA GPU(s)"
    key = "hardware" if have == 0 else "hardware.num_gpus"
    message = (
        f"hardware '{hw.name}' needs {hw.num_gpus} GPU(s) but this machine shows {what} "
        "(/dev/nvidia*, CUDA_VISIBLE_DEVICES); choose hardware=cpu here"
    )
    if cfg.run.plan_only or not runs_stages:
        plan.warn(key, message + " (a plan only: fine)")
    else:
        plan.error(key, message)


def _tracking_lines(plan: Plan, cfg: RunnerConfig, output_root: Path) -> None:
    """The MLflow store must answer before any stage runs, within tracking.connect_timeout_s."""
    uri = tracking_uri(cfg.tracking.uri, output_root)
    problem = check_store(uri, cfg.tracking.connect_timeout_s, cfg.tracking.experiment)
    plan.add("tracking", f"{uri}" + (f" ({problem})" if problem else ""))
    if problem:
        plan.error("tracking.uri", f"{uri}: {problem}")
    if cfg.tracking.register_draft:  # refused by the registry after the run, else
        name, key = registered_name(cfg.tracking.registered_model, cfg.model.name)
        wrong = registry_name_problem(name)
        if wrong:
            plan.error(
                key,
                f"the served draft would be registered as {name!r}, which MLflow's registry "
                f"refuses ({wrong}): set tracking.registered_model to another name, or "
                "tracking.register_draft=false",
            )
