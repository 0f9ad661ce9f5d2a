"""Intervals that make two recipes comparable: the acceptance length's bootstrap over prompts,
seeds as replicates, and each prompt's counts as vLLM's responses carry them."""

from __future__ import annotations

import math

import pytest

from runner.core.intervals import overlap, ratio_interval, replicates


def test_the_interval_holds_the_figure_and_narrows_with_more_prompts():
    # Prompts whose acceptance differs: 1 + accepted / drafts of all of them is the figure.
    accepted, drafts = [3, 9, 1, 6, 4, 8, 2, 7], [10, 10, 8, 12, 9, 11, 10, 10]
    value = 1 + sum(accepted) / sum(drafts)
    lo, hi = ratio_interval(accepted, drafts, offset=1.0)
    assert lo < value < hi and hi - lo > 0.1
    lo4, hi4 = ratio_interval(accepted * 4, drafts * 4, offset=1.0)
    assert lo4 < value < hi4 and (hi4 - lo4) < 0.7 * (hi - lo)
    # Fixed resampling: the same prompts give the same interval.
    assert ratio_interval(accepted, drafts, offset=1.0) == (lo, hi)
    # One prompt, or prompts that all agree, leave no spread to resample.
    assert ratio_interval([3], [10], offset=1.0) == (1.3, 1.3)
    assert ratio_interval([5, 5, 5], [10, 10, 10], offset=1.0) == pytest.approx((1.5, 1.5))


def test_seeds_as_replicates_get_a_student_t_interval():
    r = replicates([1.50, 1.56, 1.53])
    assert r.n == 3 and r.mean == pytest.approx(1.53) and r.sd == pytest.approx(0.03)
    # t(0.975, 2) = 4.303: mean +- 4.303 * sd / sqrt(3).
    assert r.hi - r.mean == pytest.approx(4.303 * 0.03 / math.sqrt(3), rel=1e-3)
    one = replicates([1.5])
    assert one.mean == 1.5 and math.isnan(one.lo)


def test_overlapping_intervals_are_inside_the_noise():
    assert overlap((1.40, 1.50), (1.48, 1.60))
    assert not overlap((1.40, 1.50), (1.51, 1.60))


def test_a_responses_own_counts_are_read_as_vllm_writes_them():
    """vLLM's per-request payload (its RequestSpecDecodeMetrics.to_dict) inside an OpenAI chat
    completion as the client library parses it: drafts, accepted and per-position counts."""
    from openai.types.chat import ChatCompletion
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

    from runner.serving.vllm_server import request_counters

    spec = RequestSpecDecodeMetrics.new(3)
    for accepted in (0, 3, 1, 2, 3):  # five verify steps of 3 drafted tokens
        spec.observe(3, accepted)
    body = {
        "id": "x",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "hi"},
            }
        ],
        "metrics": {"speculative_decoding": spec.to_dict()},
    }
    c = request_counters(ChatCompletion.model_validate(body))
    assert c == {"drafts": 5, "draft_tokens": 15, "accepted": 9, "accepted_per_pos": [4, 3, 2]}
    assert 1 + c["accepted"] / c["drafts"] == pytest.approx(
        spec.to_dict()["mean_acceptance_length"]
    )
    body.pop("metrics")
    assert request_counters(ChatCompletion.model_validate(body)) is None


def test_a_sweep_marks_jobs_within_the_best_ones_noise_and_averages_seeds():
    """Rows as the sweep reads them from MLflow: two recipes (window, full attention) over three
    seeds, each job with its interval over prompts. The best job is named, a job whose interval
    overlaps it is within its noise, and each recipe gets its mean over seeds with an interval."""
    from runner.tracking.recipes import recipes
    from runner.tracking.sweep import mark_noise, sweep_description

    def row(job, full, seed, al, half):
        return {
            "job": job,
            "run_id": f"r{job}",
            "status": "FINISHED",
            "train.full_attention_layers": full,
            "train.seed": seed,
            "acceptance_length": al,
            "acceptance_length_lo": al - half,
            "acceptance_length_hi": al + half,
        }

    rows = [
        row(0, "[]", 0, 1.50, 0.04),
        row(1, "[]", 1, 1.52, 0.04),
        row(2, "[]", 2, 1.49, 0.04),
        row(3, "[0]", 0, 1.61, 0.04),
        row(4, "[0]", 1, 1.63, 0.04),
        row(5, "[0]", 2, 1.62, 0.04),
    ]
    mark_noise(rows, "acceptance_length")
    marks = ["below", "below", "below", "within noise", "best", "within noise"]
    assert [r["vs_best"] for r in rows] == marks
    swept = ["train.full_attention_layers", "train.seed"]
    by = recipes(rows, swept, "acceptance_length")
    assert [(r["train.full_attention_layers"], r["seeds"]) for r in by] == [("[]", 3), ("[0]", 3)]
    window, full = by
    assert full["acceptance_length_mean"] == pytest.approx(1.62)
    assert full["vs_best"] == "best" and window["vs_best"] == "below"
    assert window["acceptance_length_lo"] < 1.5033 < window["acceptance_length_hi"]
    text = sweep_description(rows, swept, "acceptance_length", rows[4], by)
    assert "Within its noise (95% intervals overlap): job(s) 3, 5." in text
    assert "**Recipes over their seeds**" in text
    # Without a seed swept there are no recipes to average.
    assert recipes(rows, ["train.full_attention_layers"], "acceptance_length") == []
