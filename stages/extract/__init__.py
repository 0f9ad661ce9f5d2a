"""Stage `extract`: hidden states of the capture layers for every prepared row, in speculators'
format.

Run alone: `python -m runner run.stages=[extract]` (prepare must be in the store or run too).
Writes `hidden_states/hs_{i}.safetensors` for row i of the prepared dataset, each holding
`hidden_states` [seq, n_capture, hidden] (the last slot is the final decoder layer's output
before the final norm) and `token_ids` [seq], plus `layer_stats.json` and `capture_ids.json`.

Two backends (`extract.backend`), one module each in this package, with the same files as
output, so later stages cannot tell them apart:
- `transformers_backend`: the target in process with forward hooks on its decoder layers.
- `vllm_backend`: a vLLM server the runner starts, one request per row from the runner's own
  request loop (runner/integrations/vllm_hidden_states_client.py).
Each exposes `extract(ctx, rows, out_dir, stats)`, which writes hs_{i}.safetensors for row i,
feeds `stats`, and returns at least tokens, seconds and tokens_per_s.

Online (`extract.mode=online`, `extract=online`): nothing is extracted here. The artifact is the
record of what training will serve (`served.json`: the vLLM flags, capture ids, vLLM version,
the endpoint if one is used); the train stage starts that server and speculators fetches every
sample's states from it, every epoch again (stages/train/).
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runner.assets.target_facts import ModelFacts, Target
from runner.core.hardware_settings import DTYPE_BYTES
from runner.core.layer_ids import hook_point
from runner.core.schema import RunnerConfig
from runner.core.store import fmt_bytes, free_bytes
from runner.engine import costs
from runner.engine.checks import check_preset
from runner.engine.costs import Cost
from runner.engine.cpu_speed import cpu_rate
from runner.engine.stage import EXTRACTION, Plan, PlanView, ServerNeed, Stage, StageContext
from runner.integrations.versions import VLLM_DISTS, versions
from runner.serving.hidden_states import batch_tokens
from runner.serving.server_pool import gpu_slices, server_count
from stages.extract.samples import LayerStats
from stages.extract.settings import ExtractConfig
from stages.extract.settings import concurrency as extract_concurrency

log = logging.getLogger("runner")
# Per file beside the states: the token ids' header and bookkeeping, roughly.
_FILE_OVERHEAD_PER_TOKEN = 8


def online(cfg: RunnerConfig) -> bool:
    return cfg.extract.mode == "online"


def key_config(cfg: RunnerConfig, facts: ModelFacts) -> dict[str, Any]:
    return {
        "weights": facts.weights_id,
        "capture_ids": list(facts.extract_ids),
        "dtype": cfg.hardware.dtype,
        "backend": cfg.extract.backend,
        # Online stores nothing, so the storage does not matter there.
        **({"mode": "online"} if online(cfg) else {"storage": cfg.extract.storage}),
        # The vLLM backend's states depend on the engine and on speculators' client as well.
        **(
            {"engines": versions({"vllm": VLLM_DISTS, "speculators": ("speculators",)})}
            if cfg.extract.backend == "vllm"
            else {}
        ),
        # The target's kernel, KV cache dtype, other flags and variables change the states a
        # server captures.
        **(cfg.hardware.server_key(target_only=True) if cfg.extract.backend == "vllm" else {}),
    }


def check_target(cfg: RunnerConfig, target: Target) -> None:
    """A sweep's superset presets must give valid ids on this target, like model's own."""
    for preset in cfg.extract.superset_presets:
        check_preset(preset, target.facts.num_layers, "extract.superset_presets")


def _step(cfg: RunnerConfig) -> str:
    step = batch_tokens(cfg)
    return f", steps of up to {step:,} tokens (extract.batch_tokens)" if step else ""


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(str(dtype), str(dtype))


def bytes_per_token(slots: int, hidden: int, storage: str, dtype: str) -> int:
    """Bytes one token takes on disk: the states, plus the token id (and fp8's scale)."""
    if storage == "fp8":
        return slots * hidden + 4 + _FILE_OVERHEAD_PER_TOKEN
    return slots * hidden * DTYPE_BYTES[dtype] + _FILE_OVERHEAD_PER_TOKEN


def _record_online(ctx: StageContext) -> dict[str, Any]:
    """Online mode: the record of what the train stage serves, instead of stored states."""
    from runner.serving.hidden_states import server_args  # imports speculators: only here

    cfg, facts = ctx.cfg, ctx.facts
    prepared = ctx.inputs["prepare"].manifest.get("metrics", {})
    record = {
        "mode": "online",
        "capture_ids": list(facts.extract_ids),
        "endpoint": cfg.hardware.vllm.endpoint,
        "vllm": versions({"vllm": VLLM_DISTS})["vllm"],
        # The flags of the server the train stage starts (its hidden-state folder is in the
        # train stage's work folder); with an endpoint, the flags that server must have.
        "server_args": server_args(cfg, facts, Path("<train work folder>/online_states")),
        "serving": cfg.hardware.vllm.serving(),
        "model": facts.path,
    }
    (ctx.out / "served.json").write_text(json.dumps(record, indent=2))
    (ctx.out / "capture_ids.json").write_text(json.dumps(list(facts.extract_ids)))
    return {
        "samples": int(prepared.get("rows", prepared.get("samples", 0))),
        "tokens": int(prepared.get("tokens", 0)),
        "bytes": 0,
        "slots": len(facts.extract_ids),
    }


def run(ctx: StageContext) -> dict[str, Any]:
    if online(ctx.cfg):
        return _record_online(ctx)
    import datasets  # slow imports: only when the stage runs
    import torch

    data = datasets.load_from_disk(str(ctx.inputs["prepare"].path / "dataset"))
    rows = [torch.as_tensor(x, dtype=torch.long) for x in data.with_format(None)["input_ids"]]
    out_dir = ctx.out / "hidden_states"
    out_dir.mkdir()
    stats = LayerStats(ctx.facts.extract_ids)
    backend = importlib.import_module(f"stages.extract.{ctx.cfg.extract.backend}_backend")
    timing = backend.extract(ctx, rows, out_dir, stats)
    layer_stats = stats.as_dict()
    (ctx.out / "layer_stats.json").write_text(json.dumps(layer_stats, indent=2))
    # Which vLLM layer id each slot of the files holds (train selects its own from these).
    (ctx.out / "capture_ids.json").write_text(json.dumps(list(ctx.facts.extract_ids)))
    written = sum(p.stat().st_size for p in out_dir.iterdir())
    total_tokens = int(timing.pop("tokens"))
    return {
        "samples": len(rows),
        "tokens": total_tokens,
        "extract_s": timing.pop("seconds"),
        "bytes": written,
        "bytes_per_token": written / total_tokens,
        "slots": len(ctx.facts.extract_ids),
        **timing,
        **{f"{layer}/{name}": v for layer, st in layer_stats.items() for name, v in st.items()},
    }


def plan(p: Plan, view: PlanView) -> None:
    cfg, facts = view.cfg, view.target.facts
    ext = list(facts.extract_ids)
    if ext != list(facts.capture_ids):
        p.add(
            "extracted (shared)",
            f"{ext}: the sweep's union; this job trains on slots {list(facts.train_slots)}",
        )
    _plan_backend(p, cfg, facts, ext)
    # Hidden states on disk: the prepared token count if prepare is cached, else an upper bound.
    storage, other = cfg.extract.storage, "bf16" if cfg.extract.storage == "fp8" else "fp8"
    # "bf16" storage is the target's own dtype (hardware.dtype): float32 where the CPU has no
    # native bf16. Named so in the plan.
    shown = {s: s if s == "fp8" else _short(cfg.hardware.dtype) for s in (storage, other)}
    bpt = bytes_per_token(len(ext), facts.hidden_size, storage, cfg.hardware.dtype)
    bpt_other = bytes_per_token(len(ext), facts.hidden_size, other, cfg.hardware.dtype)
    prepared = view.cached_metrics("prepare")
    tokens = int(prepared["tokens"]) if prepared else None
    tokens_est = tokens or cfg.data.num_samples * cfg.data.max_seq_len
    bound = "" if tokens else " (upper bound: num_samples x max_seq_len)"
    if online(cfg):
        _plan_online(p, view, tokens_est, bound, {storage: bpt, other: bpt_other})
        return
    stored, free = bpt * tokens_est, free_bytes(view.output_root)
    need = stored
    if storage == "fp8" and cfg.extract.backend == "vllm":
        # vLLM's connector writes the target's dtype; the stage quantizes once the statistics
        # have read every file, so the disk must hold the bf16 files first.
        need = bpt_other * tokens_est
        p.add("fp8 with vLLM", "written in bf16, quantized at the end: the peak is the bf16 size")
    p.numbers.update(
        bytes_per_token=bpt,
        hidden_state_bytes=stored,
        free_bytes=free,
        **{f"bytes_per_token_{other}": bpt_other},
    )
    p.numbers["disk_need.extract"] = need  # named in a disk-full error, should it come
    p.add(
        "hidden states",
        f"{shown[storage]}: {fmt_bytes(bpt)}/token x {tokens_est:,} tokens{bound} = "
        f"{fmt_bytes(stored)} ({shown[other]}: {fmt_bytes(bpt_other)}/token, "
        f"{fmt_bytes(bpt_other * tokens_est)}; online: "
        f"nothing stored); free at {view.output_root}: {fmt_bytes(free)}",
    )
    rate, source = _planned_rate(view)
    runs = view.actions.get("extract") == "run"
    if rate:
        p.numbers["write_bytes_per_s"] = rate * bpt
        takes = tokens_est / rate
        p.add(
            "write bandwidth",
            f"{fmt_bytes(rate * bpt)}/s at {rate:,.0f} tokens/s ({source}); "
            # (A stored extraction is reused: nothing to take.)
            + (
                f"the extraction takes {_duration(takes)}" if runs else "reused: nothing to extract"
            ),
        )
    if not runs:
        return
    if cfg.hardware.device == "cuda":
        costs_now = [
            cost(view, nodes) for nodes in (cfg.hardware.num_nodes, cfg.hardware.num_nodes + 1)
        ]
        if costs_now[0] and costs_now[1]:
            p.add_cost("extract", costs_now[0], costs_now[1])
    _plan_disk(p, view, need, stored, bpt_other * tokens_est)


def _plan_backend(p: Plan, cfg: RunnerConfig, facts: Any, ext: list[int]) -> None:
    """Which servers or hooks extract the layers, and how."""
    if cfg.extract.backend == "vllm":
        x = cfg.extract
        v, n = cfg.hardware.vllm, server_count(cfg)
        who = (
            f"the server at {v.endpoint}:"
            if v.endpoint
            else f"{n} servers that already run (hardware.vllm.endpoints), rows shared:"
            if v.endpoints
            else "the train stage's vLLM server,"
            if online(cfg)
            else f"{n} vLLM servers started side by side (hardware.vllm.data_parallel; GPUs "
            f"{' | '.join(gpu_slices(cfg))}), rows shared:"
            if n > 1 and cfg.hardware.device == "cuda"
            else f"{n} vLLM servers started side by side on this CPU (hardware.vllm."
            "data_parallel; they share its cores), rows shared:"
            if n > 1
            else "a vLLM server,"
        )
        p.add(
            "extract backend",
            f"{who} extract_hidden_states with eagle_aux_hidden_state_layer_ids "
            f"{ext}, "
            f"chunked prefill and prefix caching off, {extract_concurrency(cfg)} requests in "
            f"flight{_step(cfg)}, {x.max_retries} retries per sample",
        )
    else:
        hooks = [f"{w}:{i}" for w, i in (hook_point(k, facts.num_layers) for k in ext)]
        p.add("transformers hooks", ", ".join(hooks))


def _plan_disk(p: Plan, view: PlanView, need: float, stored: float, other_size: float) -> None:
    """Refused where the hidden states cannot fit the free disk, naming the key that makes them
    fit; warned where they would nearly fill it."""
    cfg = view.cfg
    storage = cfg.extract.storage
    free = free_bytes(view.output_root)
    if need > free:
        fits_other = other_size <= free
        key = "extract.storage" if fits_other and storage == "bf16" else "data.num_samples"
        hint = (
            "extract.storage=fp8 would fit, or extract.mode=online stores nothing"
            if key == "extract.storage"
            else "lower data.num_samples / data.max_seq_len"
            + (", use extract.storage=fp8" if storage == "bf16" else "")
            + ", train online (extract.mode=online: nothing stored), or move run.output_root"
        )
        p.error(
            key,
            f"extraction needs {fmt_bytes(need)} ({storage}"
            f"{', written as bf16 first' if need != stored else ''}) but {view.output_root} has "
            f"{fmt_bytes(free)} free; {hint}",
        )
    elif need > 0.8 * free:
        p.warn("run.output_root", f"extraction will fill {need / free:.0%} of the free disk")


def _duration(seconds: float) -> str:
    """'~40 s', '~12 min', '~3.4 h': a plan's time in the unit that reads."""
    if seconds < 90:
        return f"~{max(seconds, 1):.0f} s"
    if seconds < 90 * 60:
        return f"~{seconds / 60:.0f} min"
    return f"~{seconds / 3600:,.1f} h"


def _planned_rate(view: PlanView) -> tuple[float | None, str]:
    """Extraction throughput for the plan: hardware.extract_tokens_per_s, else what the latest
    extraction of the same weights on this backend measured."""
    cfg = view.cfg
    if cfg.hardware.extract_tokens_per_s:
        return cfg.hardware.extract_tokens_per_s, "hardware.extract_tokens_per_s"
    art = view.store.latest("extract")
    if art is None:
        return None, ""
    m = art.manifest
    same = m.get("config", {}).get("weights") == view.target.facts.weights_id
    rate = m.get("metrics", {}).get("tokens_per_s")
    if same and m.get("config", {}).get("backend") == cfg.extract.backend and rate:
        return float(rate), f"measured by extraction {art.key}"
    return None, ""


def cost(view: PlanView, nodes: int) -> Cost | None:
    """The extraction's wall time and GPU-hours on `nodes` boxes: the server's start plus the
    tokens over (tokens/s a server x servers). In process, one pass on this box; through vLLM,
    hardware.vllm.data_parallel servers a box (the other boxes' through hardware.vllm.endpoints).
    The rate: this store's last extraction of the same weights on this hardware, else
    hardware.extract_tokens_per_s, else runner/engine/rates.yaml."""
    cfg, hw = view.cfg, view.cfg.hardware
    tokens, _exact = costs.prepared_tokens(view, "prepare")
    backend = cfg.extract.backend
    # Rows of this target at this TP: this backend's first; a start time from any backend's row
    # beats none (a 1T target loads for half an hour either way), the rate only from this one's.
    candidates = [
        r
        for r in costs.rows("extract")
        if r["model"] == cfg.model.name and r["tp"] == hw.tensor_parallel_size
    ]
    mine = costs.first_scaled(
        [r for r in candidates if r["backend"] == backend], hw.gpu_kind, "tokens_per_s"
    )
    anyone = mine or costs.first_scaled(candidates, hw.gpu_kind, "tokens_per_s")
    start = float(anyone[0]["start_s"]) if anyone else 0.0
    art = costs.measured(view, "extract")
    m = art.manifest if art is not None else {}
    if (
        m.get("metrics", {}).get("tokens_per_s")
        and m.get("model", {}).get("weights_id") == view.target.facts.weights_id
        and m.get("config", {}).get("backend") == backend
    ):
        rate = float(m["metrics"]["tokens_per_s"]) / (m["metrics"].get("servers") or 1)
        start = float(m["metrics"].get("server_start_s") or start)
        source, est = f"measured by extraction {art.key} in this store", False
    elif hw.extract_tokens_per_s:
        rate, source, est = hw.extract_tokens_per_s, "hardware.extract_tokens_per_s, planned", True
    elif mine:
        rate, source, est = mine[1]
    else:
        return None
    vllm = backend == "vllm"
    servers = max(1, hw.vllm.data_parallel) * nodes if vllm else 1
    wall = start + tokens / (rate * servers)
    across = " (a server a box: hardware.vllm.endpoints)" if vllm and nodes > 1 else ""
    return costs.Cost(
        "extraction",
        wall,
        wall * costs.box_gpus(cfg, nodes) / 3600,
        f"{tokens:,} tokens at {rate:,.0f} tok/s a server x {servers} server(s){across}, start "
        f"{costs.fmt_hours(start)} [{source}]",
        est,
    )


def _plan_online(p: Plan, view: PlanView, tokens: int, bound: str, bpt: dict[str, int]) -> None:
    """Online: nothing on disk; every epoch fetches every sample from the server again."""
    cfg = view.cfg
    epochs = cfg.train.epochs
    p.numbers.update(hidden_state_bytes=0, bytes_per_token=0, **{"disk_need.extract": 0})
    p.add(
        "hidden states",
        f"online: nothing stored; {tokens:,} tokens{bound} fetched from the server each epoch "
        f"x {epochs} epoch(s) = {tokens * epochs:,} token forwards (offline would forward each "
        f"token once and store {fmt_bytes(bpt['bf16'] * tokens)} in bf16, "
        f"{fmt_bytes(bpt['fp8'] * tokens)} in fp8)",
    )


def figures(metrics: Mapping[str, Any], _path: Path) -> dict[str, Any]:
    """Per-layer statistics of the captured states across layers, in layer order (vLLM ids)."""
    layers = sorted({int(k.split("/")[0][6:]) for k in metrics if k.startswith("layer_")})
    if not layers:
        return {}
    import matplotlib  # a second to import; only when a run logs its figures

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(10, 3.2))
    for ax, stat in zip(axes, ("rms", "max_abs", "nonfinite_fraction"), strict=True):
        ax.plot(layers, [metrics[f"layer_{i}/{stat}"] for i in layers], "o-")
        ax.set_xticks(layers)
        ax.set_xlabel("capture id (vLLM convention)")
        ax.set_title(stat.replace("_", " "))
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return {"extract/layer_stats.png": fig}


def cpu_seconds(cfg: RunnerConfig, work: Any) -> float:
    """The target's forward pass over every prepared token on this CPU (online: nothing here,
    the states are computed while training)."""
    if online(cfg):
        return 0.0
    r = cpu_rate("extract")
    flops = 2.0 * work.shape.forward_params * work.tokens
    rate = work.speed.target_gflops * 1e9 * float(r.get("efficiency", 0.6))
    return float(r.get("fixed_s", 0.0)) + flops / rate


STAGE = Stage(
    name="extract",
    rates=Path(__file__).with_name("rates.yaml"),
    settings=ExtractConfig,
    key_config=key_config,
    run=run,
    upstream=("prepare",),
    version="1",
    libraries={"torch": ("torch",), "transformers": ("transformers",)},
    identities=("tokenizer_id", "weights_id"),
    logged={"layer_stats.json": "extract", "servers.json": "extract", "logs": "extract/logs"},
    figures=figures,
    plan=plan,
    cpu_seconds=cpu_seconds,
    check_target=check_target,
    # Online, the train stage starts (or uses) the server; this stage only records it.
    server=lambda cfg: (
        ServerNeed(EXTRACTION, cfg.data.max_seq_len + 1, "data.max_seq_len", key="extract.backend")
        if cfg.extract.backend == "vllm" and not online(cfg)
        else None
    ),
    # The vLLM backend keeps finished sample files in scratch: a re-run resumes from them.
    resumable=True,
)
