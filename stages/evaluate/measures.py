"""The evaluation's figures from what the servers returned: acceptance length and per
position from counters, its 95% interval over prompts, the teacher-forced estimate from training,
where a served output leaves the target's greedy path (and whether at a near tie), and the speed
ratio with its spread; nothing here reads files or talks to a server (tests/test_acceptance_math.py
checks them on hand-made inputs).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from runner.core.intervals import ratio_interval, replicates

log = logging.getLogger("runner")


def prompt_interval(per_prompt: list[dict[str, Any]]) -> dict[str, float]:
    """The acceptance length's 95% interval over prompts (bootstrap: prompts resampled, the
    length recomputed as 1 + accepted / drafts of the sample), and the mean of the prompts' own
    lengths (each prompt weighs the same, however many drafts it took)."""
    rows = [c for c in per_prompt if c["drafts"]]
    if not rows:
        return {}
    lo, hi = ratio_interval([c["accepted"] for c in rows], [c["drafts"] for c in rows], 1.0)
    own = [1 + c["accepted"] / c["drafts"] for c in rows]
    return {
        "acceptance_length_ci_low": lo,
        "acceptance_length_ci_high": hi,
        "acceptance_length_prompt_mean": sum(own) / len(own),
    }


def acceptance(counters: dict) -> dict[str, Any]:
    drafts = counters["drafts"]
    out: dict[str, Any] = {
        "drafts": drafts,
        "draft_tokens": counters["draft_tokens"],
        "accepted_tokens": counters["accepted"],
        "acceptance_length": 1.0 + counters["accepted"] / drafts if drafts else float("nan"),
        "draft_acceptance_rate": counters["accepted"] / counters["draft_tokens"]
        if counters["draft_tokens"]
        else float("nan"),
    }
    for i, a in enumerate(counters["accepted_per_pos"]):
        out[f"acceptance_pos_{i}"] = a / drafts if drafts else float("nan")
    return out


def teacher_forced(train_metrics: dict[str, Any], k: int) -> dict[str, Any]:
    """Validation accuracies from training, per draft position, and the acceptance length they
    imply.

    speculators' `full_acc_i` is the share of supervised positions where draft steps 0..i were
    all right, with the target's own hidden states as inputs (teacher forcing); for a chain of k
    drafts that predicts an acceptance length of 1 + sum_i full_acc_i. Served acceptance is
    usually lower: at serving time the draft feeds on its own earlier states.
    """
    out: dict[str, Any] = {}
    est = 1.0
    for i in range(k):
        full = train_metrics.get(f"val_full_acc_{i}_epoch")
        cond = train_metrics.get(f"val_cond_acc_{i}_epoch")
        if full is None:
            break
        out[f"teacher_forced_full_acc_{i}"] = float(full)
        if cond is not None:
            out[f"teacher_forced_cond_acc_{i}"] = float(cond)
        est += float(full)
    if out:
        out["teacher_forced_acceptance_length"] = est
    return out


NEAR_TIE, MISMATCH, UNKNOWN = "near tie", "mismatch", "undetermined"
# A divergence past the near-tie filter that the target itself reproduces: read in one forward
# over the prompt and the served tokens (the verifier's shape), the target picks the served
# token; the two shapes' kernels, not the draft, parted the outputs.
KERNELS = "kernels"
# A proven mismatch whose prompt, served again alone on a fresh draft server, follows the
# target's greedy path through that position: the engine served the wrong token once, under
# another batch, and does not repeat it (vLLM's CPU build has, in some runs of the default).
# Still a serving fault, but one no setting of the run made: eval.transient_mismatches decides
# whether it fails the run.
TRANSIENT = "transient"
# The target's logits are bf16, so a gap between two of them is a whole number of bf16 spacings
# (0.0625, 0.125, 0.25, 0.5 at the magnitudes seen); vLLM hands them back as fp32 logprobs, whose
# log-softmax adds a few fp32 spacings either way: one H200 run read one bf16 spacing at 0.5 as
# 0.49999994 and, in the next run, as 0.50000006, which `gap <= 0.5` failed as a mismatch. Gaps
# are compared to eval.near_tie_gap with this much slack: far under the smallest bf16 spacing
# seen, far over fp32's rounding of logprobs near 0.
LOGPROB_ROUNDING = 1e-4


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ (one stopping where the other goes on
    counts), None when they are identical."""
    if a == b:
        return None
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def with_verdict(
    differs: dict[str, list[dict[str, Any] | None]], verdict: str
) -> list[tuple[str, int, dict[str, Any]]]:
    """Every divergence of one verdict, as (set, prompt index, divergence), in set order."""
    return [
        (name, i, d)
        for name, rows in differs.items()
        for i, d in enumerate(rows)
        if d is not None and d["verdict"] == verdict
    ]


def divergence(
    draft_ids: list[int],
    target_ids: list[int],
    target_top: list[list[tuple[int, float]]],
    near_tie_gap: float,
) -> dict[str, Any] | None:
    """Where a served output first differs from the target's own greedy output, and whether that
    is a near tie: at that position the token the draft-served output took is among the
    target's likeliest (`target_top`, (id, logprob) per position, likeliest first) within
    `near_tie_gap` of the target's own choice (a stop where the target went on: its runner-up
    within the gap). None when the outputs are identical."""
    j = first_difference(draft_ids, target_ids)
    if j is None:
        return None
    took = draft_ids[j] if j < len(draft_ids) else None
    row: dict[str, Any] = {"position": j, "draft_token": took}
    if j >= len(target_top) or len(target_top[j]) < 2:
        return {**row, "target_token": None, "gap": None, "verdict": UNKNOWN}
    first, lp1 = target_top[j][0]
    lp_took = dict(target_top[j]).get(took) if took is not None else target_top[j][1][1]
    # Not among the target's likeliest: at least as far below as the last of them.
    gap = lp1 - (lp_took if lp_took is not None else target_top[j][-1][1])
    near = lp_took is not None and gap <= near_tie_gap + LOGPROB_ROUNDING
    return {
        **row,
        "target_token": first,
        "runner_up": target_top[j][1][0],
        "gap": gap,
        "verdict": NEAR_TIE if near else MISMATCH,
    }


def _spread(values: list[float]) -> float:
    import statistics

    return statistics.stdev(values) if len(values) > 1 else 0.0


def speed_metrics(draft: dict[str, list[float]], target: dict[str, list[float]]) -> dict[str, Any]:
    """The speed ratio (draft-served over the target alone, warm), at concurrency 1 and at the
    evaluation's batch: each server's median tokens/s over the repeats (a repeat slowed by
    something else on the machine moves a median least), their ratio, the standard deviation of
    the per-repeat ratios as its spread, and a 95% interval: the ratio times and divided by
    exp(t * sd / sqrt(n)) of the per-repeat log ratios (each repeat pairs passes of the two
    servers timed seconds apart, so it is the unit of noise; n is 3 to 10, too few to bootstrap)."""
    import math
    import statistics

    out: dict[str, Any] = {}
    # c1, batch, and c<n> for each level of eval.concurrency (serving._speed)
    for kind in [k for k, v in draft.items() if isinstance(v, list)]:
        if not draft[kind]:
            continue
        d, t = statistics.median(draft[kind]), statistics.median(target[kind])
        out[f"speedup_{kind}"] = d / t
        ratios = [a / b for a, b in zip(draft[kind], target[kind], strict=True)]
        out[f"speedup_{kind}_std"] = _spread(ratios)
        if len(ratios) > 1:
            logs = replicates([math.log(r) for r in ratios])
            half = (logs.hi - logs.lo) / 2  # t * sd / sqrt(n), on the log scale
            out[f"speedup_{kind}_ci_low"] = d / t * math.exp(-half)
            out[f"speedup_{kind}_ci_high"] = d / t * math.exp(half)
            out[f"speedup_{kind}_ci_half_log"] = half
        out[f"draft_tok_s_{kind}"] = d
        out[f"target_tok_s_{kind}"] = t
    return out


def by_concurrency(metrics: Mapping[str, Any], levels: list[int]) -> list[dict[str, Any]]:
    """One row per level of eval.concurrency: aggregate and per-stream tokens/s of both
    servers, the gain and its 95% interval (speed_metrics' figures of kind c<n>; level 1 is c1,
    one user going through eval.speed_prompts prompts)."""
    rows = []
    for n in levels:
        kind = f"c{n}"
        if f"speedup_{kind}" not in metrics:
            continue
        d, t = metrics[f"draft_tok_s_{kind}"], metrics[f"target_tok_s_{kind}"]
        rows.append(
            {
                "concurrency": n,
                "gain": metrics[f"speedup_{kind}"],
                "gain_ci_low": metrics.get(f"speedup_{kind}_ci_low"),
                "gain_ci_high": metrics.get(f"speedup_{kind}_ci_high"),
                "draft_tok_s": d,
                "target_tok_s": t,
                "draft_tok_s_per_stream": d / n,
                "target_tok_s_per_stream": t / n,
            }
        )
    return rows


def crossover(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Where speculation stops paying: the lowest level whose gain is below 1 (its interval
    wholly below 1 makes it certain), and the highest level measured that still gains."""
    out: dict[str, Any] = {}
    below = [r for r in rows if r["gain"] < 1]
    if below:
        out["speed_crossover"] = below[0]["concurrency"]
        high = below[0]["gain_ci_high"]
        out["speed_crossover_certain"] = int(high is not None and high < 1)
    paying = [r["concurrency"] for r in rows if r["gain"] >= 1]
    if paying:
        out["speed_pays_up_to"] = max(paying)
    return out


def paired_noise(speeds: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The noise of the stage's speed ratio against the independent client's, per kind (c1,
    batch): half the width of the 95% interval of the per-repeat differences of the two
    clients' log ratios, each repeat's pair timed side by side on the same servers
    (serving._speed). Both clients read one state of the machine in a repeat, so what moves
    both (a slow minute, a server between its levels) cancels, and what is left is the
    clients' own disagreement. Kinds with fewer than two repeats are left out."""
    import math

    draft, target = speeds["draft"], speeds["target"]
    out: dict[str, float] = {}
    for kind in ("c1", "batch"):
        pairs = zip(
            draft[kind], target[kind], draft["check"][kind], target["check"][kind], strict=True
        )
        diffs = [math.log((d / t) / (dc / tc)) for d, t, dc, tc in pairs]
        if len(diffs) > 1:
            r = replicates(diffs)
            out[kind] = (r.hi - r.lo) / 2
    return out


def prompt_cells(per_prompt: list[dict[str, Any]], i: int) -> dict[str, Any]:
    """One prompt's acceptance in the per-prompt table (MLflow's evaluate/prompts.json)."""
    if i >= len(per_prompt):
        return {}
    c = per_prompt[i]
    return {
        "acceptance_length": 1 + c["accepted"] / c["drafts"] if c["drafts"] else None,
        "drafts": c["drafts"],
        "accepted": c["accepted"],
        "accepted_per_pos": c["accepted_per_pos"],
    }


def proven(d: dict[str, Any] | None, rescored: dict[str, Any] | None) -> dict[str, Any] | None:
    """A divergence with its proof. The gap filter passes near ties as they are; any other
    divergence is decided by the target alone re-reading the served prefix in one forward
    (`rescored`: the served token's rank there, 1 = the target's own pick): rank 1 proves it the
    kernels' (KERNELS), any other rank a real MISMATCH. Without a re-reading (a server that
    gives no prompt logprobs) the filter's verdict stands, marked unproven."""
    if d is None:
        return None
    if d["verdict"] == NEAR_TIE:
        return {**d, "proof": f"gap {d['gap']:.4g} within eval.near_tie_gap"}
    if not rescored or rescored.get("rank") is None:
        return {**d, "proof": "none: the target could not re-read the prefix (unproven)"}
    rank = int(rescored["rank"])
    how = (
        f"the target, reading the prompt and the {d['position'] + 1} served tokens in one "
        f"forward, ranks the served token {rank}"
    )
    if rescored.get("top") is not None:
        how += f" (its own pick there: {rescored['top']})"
    return {**d, "verdict": KERNELS if rank == 1 else MISMATCH, "proof": how, "rescored_rank": rank}


def rechecked(d: dict[str, Any], again: list[int], target: list[int]) -> dict[str, Any]:
    """A proven mismatch `d` after its prompt was served again alone on a fresh draft server
    (`again`, against the target's own output `target`): through `d`'s position on the target's
    path, it did not repeat (TRANSIENT); the same token there, it is reproduced; leaving the
    target's path elsewhere, it stays a mismatch, with where it left said."""
    j = d["position"]
    took = first_difference(again, target)
    if took is None or took > j:
        return {
            **d,
            "verdict": TRANSIENT,
            "proof": f"{d['proof']}; served again alone on a fresh draft server, it follows "
            f"the target's path through position {j}: not repeated",
        }
    same = took == j and j < len(again) and again[j] == d["draft_token"]
    where = "the same token at the same position" if same else f"off the path at position {took}"
    return {
        **d,
        "proof": f"{d['proof']}; served again alone on a fresh draft server: {where} (reproduced)",
        "reproduced": same,
    }


def identity_counts(differs: dict[str, list[dict[str, Any] | None]]) -> dict[str, Any]:
    flat = [d for rows in differs.values() for d in rows]
    verdicts = [d["verdict"] for d in flat if d is not None]
    return {
        "identical_to_target_fraction": sum(d is None for d in flat) / len(flat),
        "near_ties": verdicts.count(NEAR_TIE),
        "kernel_divergences": verdicts.count(KERNELS),
        "mismatches": verdicts.count(MISMATCH),
        "transient_mismatches": verdicts.count(TRANSIENT),
        "undetermined": verdicts.count(UNKNOWN),
    }


def report_mismatches(differs: dict[str, list[dict[str, Any] | None]]) -> None:
    """An output that leaves the target's greedy path where the target was not near a tie is
    not bf16 noise: the identity check fails, naming the first such prompt (the figures are
    still published, with every divergence in identity.json and MLflow's evaluate/identity
    table, so that each can be looked at)."""
    bad = with_verdict(differs, MISMATCH)
    near = len(with_verdict(differs, NEAR_TIE))
    if near:
        log.info(
            "[evaluate] %d output(s) leave the target's greedy path at a near tie "
            "(logprob gap <= eval.near_tie_gap): bf16 kernels of another batch shape",
            near,
        )
    once = with_verdict(differs, TRANSIENT)
    if once:
        name, i, d = once[0]
        log.warning(
            "[evaluate] %d output(s) served with the draft left the target's greedy path once "
            "and, served again alone on a fresh draft server, did not: a serving engine's fault "
            "that no setting of this run made (eval.transient_mismatches); first: set %s, "
            "prompt %d, position %d (target token %s, served %s): see identity.json",
            len(once),
            name,
            i,
            d["position"],
            d["target_token"],
            d["draft_token"],
        )
    if bad:
        name, i, d = bad[0]
        gap = "n/a" if d["gap"] is None else f"{d['gap']:.3f}"
        log.error(
            "[evaluate] identity check FAILED: %d output(s) served with the draft differ from the "
            "target's own where the target was not near a tie and, re-reading the prefix, does "
            "not pick the served token; first: set %s, prompt %d, position %d (target token %s, "
            "served %s, logprob gap %s > eval.near_tie_gap). Speculative decoding must not change "
            "greedy output: see identity.json",
            len(bad),
            name,
            i,
            d["position"],
            d["target_token"],
            d["draft_token"],
            gap,
        )


def gate(metrics: Mapping[str, Any], floor: float | None, sets: list[str]) -> list[str]:
    """What fails the evaluation: a prompt set whose acceptance length's 95% interval lies at or
    below `floor`, and outputs proven to leave the target's greedy path. `sets`: the prompt
    sets, the first under the plain metric names."""
    out = []
    for k, name in enumerate(sets):
        pre = "" if k == 0 else f"{name}/"
        mean = metrics.get(f"{pre}acceptance_length")
        high = metrics.get(f"{pre}acceptance_length_ci_high", mean)
        if floor is not None and high is not None and high <= floor:
            out.append(
                f"{name}: acceptance length {mean if mean is not None else high:.3f}, "
                f"its interval at or below eval.acceptance_floor={floor:g}: a trained draft does "
                "not serve this close to 1.0; check the attention backend (FLASHINFER_MLA with an "
                "fp8 KV cache on compute capability 12.x accepts nothing), the capture ids, the "
                "vocabulary mapping, and that the target is the one the draft was trained on"
            )
    if metrics.get("mismatches"):
        out.append(
            f"identity check: {metrics['mismatches']:.0f} output(s) served with the draft leave "
            "the target's greedy path where the target itself does not pick the served token "
            "(identity.json names each, with its proof)"
        )
    return out


def transient(metrics: Mapping[str, Any]) -> list[str]:
    """Outputs that left the target's greedy path once and not when served again (TRANSIENT):
    what eval.transient_mismatches fails the run on, or warns of."""
    n = metrics.get("transient_mismatches")
    if not n:
        return []
    return [
        f"identity check: {n:.0f} output(s) served with the draft left the target's greedy path "
        "once and followed it when served again alone on a fresh draft server: the serving "
        "engine's fault, not this run's settings (identity.json names each, with its proof)"
    ]


def per_set(measured: dict[str, Any]) -> dict[str, Any]:
    """The figures a set other than the run's own keeps (and a baseline draft's): the
    acceptance length, the draft acceptance rate and each position's."""
    keep = ("acceptance_length", "draft_acceptance_rate")
    return {k: v for k, v in measured.items() if k in keep or "_pos_" in k}
