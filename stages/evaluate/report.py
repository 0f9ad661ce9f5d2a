"""What an evaluation shows: the summary lines, one row per prompt set (the card's and reports'),
the sweep comparison's columns, MLflow's tables and the acceptance-by-position figure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runner.assets.prompts import prompt_set_name, shown, user_turns
from runner.core.schema import RunnerConfig
from runner.engine.stage import StageContext
from runner.serving.vllm_server import shell_command
from stages.evaluate.measures import gate, prompt_cells, transient
from stages.evaluate.prompt_sets import prompt_sources
from stages.evaluate.serving import server_args


def set_names(cfg: RunnerConfig) -> list[str]:
    return [prompt_set_name(p) for p in prompt_sources(cfg)]


def results(metrics: Mapping[str, Any], cfg: RunnerConfig) -> list[dict[str, Any]]:
    """One row per prompt set: what a published card and a report show. The first set's metrics
    carry no prefix (it is the run's objective), the others "<set>/"."""
    rows = []
    for i, name in enumerate(set_names(cfg)):
        pre = "" if i == 0 else f"{name}/"
        if f"{pre}acceptance_length" not in metrics:
            continue
        rows.append(
            {
                "set": name,
                "prompts": metrics.get(f"{pre}prompts"),
                "multi_turn_prompts": metrics.get(f"{pre}multi_turn_prompts"),
                "k": cfg.eval.num_speculative_tokens,
                "acceptance_length": metrics[f"{pre}acceptance_length"],
                "ci95": _ci(metrics, pre),
                "per_position": [v for _, v in _positions(metrics, pre)],
                "speedup_c1": metrics.get("speedup_c1") if i == 0 else None,
                "speedup_batch": metrics.get("speedup_batch") if i == 0 else None,
                "random_acceptance_length": (
                    metrics.get("random_acceptance_length") if i == 0 else None
                ),
            }
        )
    return rows


def _ci(metrics: Mapping[str, Any], pre: str = "") -> list[float] | None:
    lo, hi = (metrics.get(f"{pre}acceptance_length_ci_{e}") for e in ("low", "high"))
    return None if lo is None or hi is None else [lo, hi]


def _speed_ci(metrics: dict[str, Any], kind: str) -> str:
    """The speed ratio's 95% interval, where there were repeats enough for one."""
    lo, hi = metrics.get(f"speedup_{kind}_ci_low"), metrics.get(f"speedup_{kind}_ci_high")
    return f" (95% {lo:.2f}-{hi:.2f})" if lo is not None and hi is not None else ""


def summary(metrics: dict[str, Any], path: Path, cfg: RunnerConfig) -> list[str]:
    if metrics.get("acceptance_length") is None:
        return []
    same = metrics.get("identical_to_target_fraction")
    lines = []
    for row in results(metrics, cfg):
        per_pos = " / ".join(f"{v:.3f}" for v in row["per_position"])
        ci = row["ci95"]
        spread = f"95% interval {ci[0]:.3f}-{ci[1]:.3f} over " if ci else ""
        multi = row["multi_turn_prompts"]
        turns = f", {multi:.0f} multi-turn" if multi else ""
        lines.append(
            f"acceptance length {row['acceptance_length']:.3f} on {row['set']} ({spread}"
            f"{row['prompts']} prompts{turns}; k={row['k']}, per position {per_pos})"
        )
    if "speedup_c1" in metrics:
        lines.append(
            f"speed, warm, draft-served over the target alone ({metrics['speed_repeats']:.0f} "
            f"repeat{'' if metrics['speed_repeats'] == 1 else 's'}{_timing(metrics)}; ratio of "
            "median tokens/s ± sd of the per-repeat "
            "ratios): "
            f"{metrics['speedup_c1']:.2f}x ± "
            f"{metrics['speedup_c1_std']:.2f}{_speed_ci(metrics, 'c1')} at concurrency 1, "
            f"{metrics['speedup_batch']:.2f}x ± {metrics['speedup_batch_std']:.2f}"
            f"{_speed_ci(metrics, 'batch')} at batch {metrics['speed_batch']:.0f}"
            + (
                " (on a CPU this ratio says nothing about a GPU: vLLM warns that speculative "
                "decoding on a CPU without Intel OpenMP loses much of its speed)"
                if cfg.hardware.device == "cpu"
                else ""
            )
        )
    lines += _concurrency_lines(metrics, path)
    lines += _baseline_lines(metrics, path, cfg)
    lines += _speed_check_lines(metrics)
    extra = []
    if same is not None:
        one = {
            "near_ties": "near tie",
            "kernel_divergences": "kernel divergence",
            "mismatches": "mismatch",
            "undetermined": "undetermined",
        }
        differ = [
            f"{metrics[k]:.0f} {one[k] if metrics[k] == 1 else k.replace('_', ' ')}"
            for k in one
            if metrics.get(k)
        ]
        extra.append(
            f"identical to target: {same:.0%}"
            + (f" (the rest: {', '.join(differ)})" if differ else "")
            + ("; IDENTITY CHECK FAILED (identity.json)" if metrics.get("mismatches") else "")
        )
    if "random_acceptance_length" in metrics:
        extra.append(f"random draft {metrics['random_acceptance_length']:.3f}")
    if "teacher_forced_acceptance_length" in metrics:
        extra.append(f"teacher-forced estimate {metrics['teacher_forced_acceptance_length']:.3f}")
    if extra:
        lines.append(", ".join(extra))
    return [*lines, f"serve it: {serve_command(cfg, path)}"]


def _speed_check_lines(metrics: Mapping[str, Any]) -> list[str]:
    """The independent client's verdict on the speed ratio (eval.speed_check), if it ran."""
    if "speed_check_agrees" not in metrics:
        return []
    diffs = ", ".join(
        f"{metrics[f'speed_check_{k}']:.2f}x at {where} ({metrics[f'speed_check_{k}_diff']:+.0%})"
        for k, where in (("c1", "concurrency 1"), ("batch", "batch"))
        if f"speed_check_{k}" in metrics
    )
    verdict = "agrees within 10%" if metrics["speed_check_agrees"] else "SPEED CHECK DISAGREES"
    noise = [k for k in ("c1", "batch") if f"speed_check_{k}_within_noise" in metrics]
    if not metrics["speed_check_agrees"] and noise:
        if all(metrics[f"speed_check_{k}_within_noise"] for k in noise):
            widest = max(metrics[f"speed_check_{k}_noise"] for k in noise)
            verdict = (
                "more than 10% apart, but within the two measurements' own noise "
                f"(up to ±{widest:.0%} at 95%): more repeats (eval.speed_repeats) or longer "
                "passes (eval.speed_pass_s) resolve 10%"
            )
        else:
            verdict += ", by more than the two measurements' own noise"
    return [
        f"speed checked on the same servers by an independent client (eval.speed_check): "
        f"{diffs} ({verdict}; in brackets the stage's ratio against it)"
    ]


def _baseline_lines(metrics: Mapping[str, Any], path: Path, cfg: RunnerConfig) -> list[str]:
    """The run's draft against eval.baseline_draft, set by set, with the verdict."""
    try:
        rows = json.loads((path / "baseline.json").read_text())
    except (OSError, ValueError):
        return []
    cells = [
        f"{r['set']} {r['acceptance_length']:.3f} against {r['baseline_acceptance_length']:.3f} "
        f"({r['difference']:+.3f}, 95% {r['difference_ci_low']:+.3f} to "
        f"{r['difference_ci_high']:+.3f}: {r['verdict']})"
        for r in rows
    ]
    line = f"against the baseline draft {cfg.eval.baseline_draft}: " + "; ".join(cells)
    if "baseline/speedup_c1" in metrics and "speedup_c1" in metrics:
        line += (
            f"; speed at concurrency 1 {metrics['speedup_c1']:.2f}x against "
            f"{metrics['baseline/speedup_c1']:.2f}x"
        )
    return [line]


def _concurrency_lines(metrics: Mapping[str, Any], path: Path) -> list[str]:
    """The gain at each level of eval.concurrency, where it stops paying, and what the draft
    costs of the KV cache."""
    lines = []
    try:
        rows = json.loads((path / "concurrency.json").read_text())
    except (OSError, ValueError):
        rows = []
    if rows:
        cells = []
        for r in rows:
            lo, hi = r.get("gain_ci_low"), r.get("gain_ci_high")
            ci = f" ({lo:.2f}-{hi:.2f})" if lo is not None and hi is not None else ""
            cells.append(
                f"{r['concurrency']}: {r['gain']:.2f}x{ci}, "
                f"{r['draft_tok_s_per_stream']:.1f} against {r['target_tok_s_per_stream']:.1f} "
                "tok/s a stream"
            )
        if "speed_crossover" in metrics:
            n = metrics["speed_crossover"]
            where = f"stops paying at {n:.0f} stream{'' if n == 1 else 's'}" + (
                "" if metrics.get("speed_crossover_certain") else " (within its noise)"
            )
        else:
            where = "pays at every level measured"
        lines.append(f"gain by concurrency (eval.concurrency): {'; '.join(cells)}; {where}")
    if "draft_kv_cache_tokens" in metrics:
        d = metrics["draft_kv_cache_tokens"]
        fits = metrics.get("draft_kv_max_concurrency")
        line = f"KV cache: {d:,.0f} tokens with the draft" + (
            f" ({fits:.1f} requests of {metrics['draft_kv_tokens_per_request']:,.0f} tokens at "
            "once)"
            if fits is not None
            else ""
        )
        if "kv_cost" in metrics:
            target_fits = metrics.get("target_kv_max_concurrency")
            line += (
                f", {metrics['target_kv_cache_tokens']:,.0f} without"
                + (f" ({target_fits:.1f})" if target_fits is not None else "")
                + f": the draft costs {metrics['kv_cost']:.1%} of it"
            )
        lines.append(line)
    return lines


def _timing(metrics: Mapping[str, Any]) -> str:
    """How the two servers were timed, and whether each compiled its graphs in this start."""
    out = ""
    if "speed_servers_together" in metrics:
        out += (
            ", both servers up, passes alternating"
            if metrics["speed_servers_together"]
            else ", one server after the other"
        )
    cold = {s: metrics.get(f"{s}_compile_cold") for s in ("draft", "target")}
    if None not in cold.values():
        state = {s: "cold" if c else "cached" for s, c in cold.items()}
        out += f", compiled: draft-served {state['draft']}, target {state['target']}"
    return out


def serve_command(cfg: RunnerConfig, path: Path) -> str:
    """The command that serves the target with the evaluated draft on this machine as the
    evaluation did (the same engine flags: dtype, context, and on CPU the memory settings)."""
    try:
        served = json.loads((path / "manifest.json").read_text())["served"]
    except (OSError, ValueError, KeyError):
        return "(see the evaluation's manifest)"
    if "serve_command" in served:
        return served["serve_command"]
    return shell_command(cfg, served["target"], server_args(cfg, Path(served["draft"])))


def _positions(metrics: Mapping[str, Any], pre: str = "") -> list[tuple[int, float]]:
    """(position, acceptance) for every draft position the metrics hold (of the set whose
    prefix is `pre`), in order."""
    prefix = f"{pre}acceptance_pos_"
    found = [(int(k[len(prefix) :]), v) for k, v in metrics.items() if k.startswith(prefix)]
    return sorted(found)


def _other_sets(metrics: Mapping[str, Any]) -> list[str]:
    """The prompt sets after the first, as their metrics name them ("humaneval/...")."""
    return sorted({k.split("/", 1)[0] for k in metrics if k.endswith("/acceptance_length")})


def columns(metrics: Mapping[str, float]) -> dict[str, float | None]:
    return {
        "acceptance_length": metrics.get("acceptance_length"),
        # The objective's interval: the sweep comparison marks differences inside it.
        "acceptance_length_lo": metrics.get("acceptance_length_ci_low"),
        "acceptance_length_hi": metrics.get("acceptance_length_ci_high"),
        **{f"acc_pos_{i}": v for i, v in _positions(metrics)},
        **{f"al_{name}": metrics.get(f"{name}/acceptance_length") for name in _other_sets(metrics)},
        "teacher_forced_al": metrics.get("teacher_forced_acceptance_length"),
    }


def tables(_metrics: Mapping[str, Any], path: Path) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for name, logged in (
        ("eval_table.json", "prompts.json"),
        ("identity.json", "identity.json"),
        ("concurrency.json", "concurrency.json"),
        ("baseline.json", "baseline.json"),
    ):
        if (path / name).is_file():
            rows = json.loads((path / name).read_text())
            if rows:
                out[f"evaluate/{logged}"] = rows
    return out


def figures(metrics: Mapping[str, Any], _path: Path) -> dict[str, Any]:
    """Acceptance by draft position, the trained draft against the random one (when measured)
    and the teacher-forced estimate."""
    positions = _positions(metrics)
    if not positions:
        return {}
    import matplotlib  # a second to import; only when a run logs its figures

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = [p for p, _ in positions]
    bars = [("served draft", [v for _, v in positions])]
    bars += [
        (f"served draft, {name}", [v for _, v in _positions(metrics, f"{name}/")])
        for name in _other_sets(metrics)
    ]
    rand = [metrics.get(f"random_acceptance_pos_{p}") for p in xs]
    if all(v is not None for v in rand):
        bars.append(("random draft", rand))
    width = 0.8 / len(bars)
    for j, (label, values) in enumerate(bars):
        offset = (j - (len(bars) - 1) / 2) * width
        ax.bar([x + offset for x in xs[: len(values)]], values, width=width, label=label)
    tf = [metrics.get(f"teacher_forced_full_acc_{p}") for p in xs]
    if all(v is not None for v in tf):
        ax.plot(xs, tf, "k--o", label="teacher-forced estimate")
    ax.set_xticks(xs, [str(x + 1) for x in xs])
    ax.set_xlabel("draft position (share of drafts accepted up to it)")
    ax.set_ylabel("acceptance rate")
    ax.set_title(f"acceptance length {metrics.get('acceptance_length', float('nan')):.3f}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return {"evaluate/acceptance_by_position.png": fig}


def write_tables(
    ctx: StageContext,
    sets: dict[str, list[Any]],
    spec: dict[str, dict],
    identical: dict[str, list[bool | None]],
    differs: dict[str, list[dict[str, Any] | None]],
) -> None:
    """identity.json (each divergence with its proof) and eval_table.json (one row a prompt)."""
    identity = [
        {"set": name, "index": i, "prompt": shown(sets[name][i], 200), **d}
        for name in sets
        for i, d in enumerate(differs[name])
        if d is not None
    ]
    (ctx.out / "identity.json").write_text(json.dumps(identity, indent=1))
    table = [
        {
            "set": name,
            "index": i,
            "prompt": shown(p, 300),
            "user_turns": user_turns(p),
            "prompt_tokens": spec[name]["prompt_tokens"][i],
            "new_tokens": len(spec[name]["token_ids"][i]),
            "identical_to_target": identical[name][i],
            "differs": (differs[name][i] or {}).get("verdict"),
            **prompt_cells(spec[name]["per_prompt"], i),
            "output": spec[name]["texts"][i],
        }
        for name, prompts in sets.items()
        for i, p in enumerate(prompts)
    ]
    (ctx.out / "eval_table.json").write_text(json.dumps(table, indent=1))


def inputs(metrics: Mapping[str, Any], cfg: RunnerConfig, path: Path) -> list[dict[str, Any]]:
    """The prompt sets as MLflow run inputs (context evaluation), each with its prompts (the
    text shown in the per-prompt table, its user turns and tokens) as the dataset's rows."""
    try:
        served = json.loads((path / "eval_table.json").read_text())
    except (OSError, ValueError):
        served = []
    found = []
    for i, (name, source) in enumerate(zip(set_names(cfg), prompt_sources(cfg), strict=True)):
        pre = "" if i == 0 else f"{name}/"
        if f"{pre}prompts" in metrics:
            found.append(
                {
                    "name": name,
                    "source": source,
                    "digest": f"{path.name}-{name}",
                    "context": "evaluation",
                    "rows": metrics[f"{pre}prompts"],
                    "table": [
                        {k: r.get(k) for k in ("index", "prompt", "user_turns", "prompt_tokens")}
                        for r in served
                        if r.get("set") == name
                    ],
                }
            )
    return found


def served_draft(path: Path) -> Path | None:
    """The draft an evaluation served (the run's, or the epoch it chose), from its manifest."""
    try:
        return Path(json.loads((path / "manifest.json").read_text())["served"]["draft"])
    except (OSError, ValueError, KeyError):
        return None


def transient_gate(cfg: RunnerConfig) -> str:
    """eval.transient_mismatches, or its default: fail on a GPU, warn on a CPU."""
    if cfg.eval.transient_mismatches is not None:
        return str(cfg.eval.transient_mismatches)
    return "fail" if cfg.hardware.device == "cuda" else "warn"


def gates(metrics: Mapping[str, Any], cfg: RunnerConfig) -> tuple[list[str], list[str]]:
    """What fails the run and what only warns: the floor and the identity check
    (eval.acceptance_floor, eval.gates), and transient mismatches (eval.transient_mismatches)."""
    failed = gate(metrics, cfg.eval.acceptance_floor, set_names(cfg))
    once = transient(metrics)
    if transient_gate(cfg) == "fail":
        failed, once = failed + once, []
    return (failed, once) if cfg.eval.gates == "fail" else ([], failed + once)
