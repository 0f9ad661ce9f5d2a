"""The train stage's plan lines: speculators' own refusals of the settings, the cost on this
hardware and with one more box, the draft's shape and memory, the draft's attention, the disk
that kept epoch drafts need. Reads config files and the store only."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from runner.core.schema import RunnerConfig
from runner.core.store import fmt_bytes, free_bytes
from runner.engine import costs
from runner.engine.stage import Plan, PlanView
from runner.integrations.speculators_config import Refused, resolve_train_config
from runner.integrations.speculators_settings import setting_key, speculators_settings
from stages.train.draft_estimate import draft_params, plan_memory
from stages.train.online import plan_online
from stages.train.settings import train_ranks

log = logging.getLogger("runner")


def _check_with_speculators(p: Plan, view: PlanView) -> None:
    """The settings this run will pass, resolved by the installed speculators' own TrainConfig
    (paths are placeholders: only values are checked), before any stage runs."""
    where = Path("/nonexistent/plan")
    online = "http://127.0.0.1:8000/v1" if view.cfg.extract.mode == "online" else None
    settings = speculators_settings(
        view.cfg,
        view.target.facts,
        where / "data",
        where / "hs",
        where / "vocab",
        where / "save",
        online=online,
    )
    try:
        resolve_train_config(settings, view.target.facts.train_slots)
    except Refused as exc:
        p.error(setting_key(view.cfg, exc.dest), f"speculators refuses it: {exc.message}")


def cost(view: PlanView, nodes_: int) -> costs.Cost | None:
    """Training's wall time and GPU-hours on `nodes_` boxes: the seconds outside the steps plus
    tokens x epochs over (tokens/s a GPU x ranks x efficiency). The rate: this store's last
    training of a draft of the same shape on this hardware, else runner/engine/rates.yaml's row
    nearest in hidden size (scaled by draft size when the shape differs: an estimate)."""
    cfg = view.cfg
    hidden, vocab = view.target.facts.hidden_size, cfg.vocab.draft_vocab_size
    table = costs.rows("train")
    if not table or not cfg.hardware.gpu_kind:
        return None
    row = min(
        table,
        key=lambda r: (abs(math.log(r["hidden"] / hidden)), r["gpu"] != cfg.hardware.gpu_kind),
    )
    art = costs.measured(view, "train")
    m = art.manifest if art is not None else {}
    if (
        m.get("metrics", {}).get("tokens_per_s_median")
        and m.get("model", {}).get("hidden_size") == hidden
        and m.get("config", {}).get("draft_vocab_size") == vocab
    ):
        rate = float(m["metrics"]["tokens_per_s_median"]) / (m["config"].get("ranks") or 1)
        source, est = f"measured by training {art.key} in this store", False
    else:
        got = costs.scaled(row, cfg.hardware.gpu_kind, float(row["tokens_per_s_per_gpu"]))
        if got is None:
            return None
        rate, source, est = got
        shape = _draft_work(row["hidden"], row["draft_vocab"]) / _draft_work(hidden, vocab)
        if abs(shape - 1) > 0.01:
            rate *= shape
            source = (
                f"estimate: scaled {shape:.2f}x by draft size from hidden {row['hidden']}, vocab "
                f"{row['draft_vocab']} ({source})"
            )
            est = True
    ranks = train_ranks(cfg) * nodes_
    eff = costs.efficiency(ranks, float(row["efficiency_2"]))
    tokens, _exact = costs.prepared_tokens(view, "prepare")
    wall = float(row["fixed_s"]) + tokens * cfg.train.epochs / (rate * ranks * eff)
    return costs.Cost(
        "training",
        wall,
        wall * costs.box_gpus(cfg, nodes_) / 3600,
        f"{cfg.train.epochs} epoch(s) x {tokens:,} tokens at {rate:,.0f} tok/s a GPU x {ranks} "
        f"GPU(s) x {eff:.2f} scaling [{source}]",
        est or ranks > 2,
    )


def _draft_work(hidden: int, vocab: int) -> float:
    """A proxy of one draft token's work: the layer and fc (~16 h^2) and the head (h x V)."""
    return 16 * hidden * hidden + hidden * vocab


def plan(p: Plan, view: PlanView) -> None:
    cfg, layout = view.cfg, view.target.layout
    if view.actions.get("train") == "run":
        _check_with_speculators(p, view)
        if cfg.hardware.device == "cuda":
            now, more = (
                cost(view, n) for n in (cfg.hardware.num_nodes, cfg.hardware.num_nodes + 1)
            )
            if now and more:
                p.add_cost("train", now, more)
    t, h, vd = cfg.train, layout.hidden_size, cfg.vocab.draft_vocab_size
    params = draft_params(cfg, view.target)
    aux = len(view.target.facts.aux_layers)
    p.numbers["draft_params"] = params
    if t.num_layers > layout.num_layers:
        p.error(
            "train.num_layers",
            f"a draft of {t.num_layers} layers is deeper than the target ({layout.num_layers}): "
            "it would be slower than the target it drafts for (EAGLE-3 drafts have 1 to 2)",
        )
    if t.keep_epoch_drafts and view.actions.get("train") == "run":
        # Each kept draft in bf16, next to the artifact's own and a resumable checkpoint.
        need, free = (t.epochs + 2) * params * 2, free_bytes(view.output_root)
        p.numbers["epoch_drafts_bytes"] = need
        if free is not None and need > free:
            p.error(
                "train.keep_epoch_drafts",
                f"{t.epochs} epochs' drafts need ~{fmt_bytes(need)} but {view.output_root} has "
                f"{fmt_bytes(free)} free; keep fewer (fewer train.epochs) or set it false",
            )
    p.add(
        "draft",
        f"{t.num_layers} layer(s), fc {aux}x{h}->{h}, draft vocab {vd} of {layout.vocab_size}, "
        f"~{params / 1e6:.0f}M params, {t.ttt_steps} TTT steps",
    )
    p.add("draft attention", attention_line(cfg))
    seq = t.total_seq_len or cfg.data.max_seq_len
    draft_logits, full_logits = seq * vd * 4, seq * layout.vocab_size * 4
    p.numbers.update(teacher_logits_bytes=draft_logits, full_vocab_logits_bytes=full_logits)
    p.add(
        "teacher logits",
        f"{seq} tokens x {vd} draft vocab x fp32 = {fmt_bytes(draft_logits)} per batch (full vocab "
        f"would be {fmt_bytes(full_logits)}; {fmt_bytes(layout.vocab_size * 4)}/token)",
    )
    ranks, hw = train_ranks(cfg), cfg.hardware
    mode = "in this process" if ranks == 1 else f"torchrun, {'FSDP2' if t.fsdp else 'DDP'}"
    every = (
        f"every {t.checkpoint_every:g} epoch(s)" if t.checkpoint_every else "at each epoch's end"
    )
    what = "GPU(s)" if hw.device == "cuda" else "CPU process(es)"
    p.add(
        "training",
        f"{ranks} {what} ({mode}; train.num_gpus, train.fsdp), checkpoints {every} "
        "(train.checkpoint_every)"
        + (
            f"; every epoch's draft kept ({t.epochs} x the draft's size)"
            if t.keep_epoch_drafts
            else ""
        ),
    )
    if cfg.extract.mode == "online":
        plan_online(p, cfg)
    if hw.device != "cuda":
        return
    plan_memory(p, cfg, view.target)


def attention_line(cfg: RunnerConfig) -> str:
    """The draft layers' attention in words (train.sliding_window, train.full_attention_layers),
    and whether the window can bind at all: contexts no longer than it see everything."""
    t = cfg.train
    full = sorted(t.full_attention_layers)
    window = [i for i in range(t.num_layers) if i not in full]
    parts = []
    if window:
        layers = "every layer" if not full else f"layer(s) {window}"
        parts.append(f"{layers}: sliding window of {t.sliding_window} tokens")
    if full:
        parts.append(f"layer(s) {full}: full attention")
    longest = cfg.data.max_seq_len  # packed rows keep their conversations apart
    note = ""
    if window and t.sliding_window >= longest:
        note = (
            f" (the window covers training's {longest}-token rows: the same as full attention "
            "there; it binds on longer served contexts)"
        )
    return "; ".join(parts) + note + " (train.sliding_window, train.full_attention_layers)"
