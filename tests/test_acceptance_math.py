"""The arithmetic behind the reported acceptance: counter deltas, acceptance length and
per-position rates, the teacher-forced estimate, and the sweep table with k=5 positions."""

from __future__ import annotations

import json
import math

import mlflow
import pytest

from runner.serving.vllm_server import counters_delta
from runner.tracking.job_tags import COLUMNS_TAG, OBJECTIVE_TAG
from runner.tracking.sweep import comparison_rows, render_table
from stages.evaluate.measures import acceptance, teacher_forced
from stages.evaluate.report import columns as evaluate_columns


def test_counter_deltas_count_only_these_prompts():
    before = {"drafts": 10, "draft_tokens": 30, "accepted": 7, "accepted_per_pos": [5, 2]}
    # A position first seen after the prompts (no count before) starts from zero.
    after = {"drafts": 30, "draft_tokens": 90, "accepted": 27, "accepted_per_pos": [15, 9, 3]}
    assert counters_delta(after, before) == {
        "drafts": 20,
        "draft_tokens": 60,
        "accepted": 20,
        "accepted_per_pos": [10, 7, 3],
    }


def test_acceptance_length_is_one_plus_accepted_per_draft():
    m = acceptance(
        {"drafts": 20, "draft_tokens": 60, "accepted": 20, "accepted_per_pos": [10, 7, 3]}
    )
    assert m["acceptance_length"] == 2.0  # 1 + 20 / 20
    assert m["draft_acceptance_rate"] == pytest.approx(1 / 3)
    assert [m[f"acceptance_pos_{i}"] for i in range(3)] == [0.5, 0.35, 0.15]
    # Positions sum to the accepted tokens per draft.
    assert sum(m[f"acceptance_pos_{i}"] for i in range(3)) == pytest.approx(1.0)


def test_no_drafts_gives_no_number_rather_than_a_wrong_one():
    m = acceptance({"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []})
    assert math.isnan(m["acceptance_length"]) and math.isnan(m["draft_acceptance_rate"])


def test_teacher_forced_estimate_sums_full_accuracies_up_to_k():
    train = {
        "val_full_acc_0_epoch": 0.4,
        "val_full_acc_1_epoch": 0.2,
        "val_cond_acc_1_epoch": 0.5,
        "val_full_acc_2_epoch": 0.1,
        "val_full_acc_3_epoch": 0.05,
    }
    m = teacher_forced(train, k=3)
    assert m["teacher_forced_acceptance_length"] == pytest.approx(1.7)  # position 3 is past k
    assert m["teacher_forced_cond_acc_1"] == 0.5 and "teacher_forced_full_acc_3" not in m
    assert teacher_forced({}, k=3) == {}


def test_sweep_table_has_a_column_per_position_for_every_k(tmp_path):
    """A sweep over k: the k=5 job's positions 3 and 4 appear, in order, and the k=3 job shows
    none there (not zero)."""
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("eagle3", artifact_location=(tmp_path / "art").as_uri())
    params = json.dumps({"eval.num_speculative_tokens": "3,5"})
    parent = client.create_run(exp, tags={"sweep.config": "k", "sweep.params": params})
    for job, k in enumerate((3, 5)):
        child = client.create_run(
            exp,
            tags={
                "mlflow.parentRunId": parent.info.run_id,
                "sweep.job": str(job),
                "stage.evaluate": "computed",
            },
        )
        run_id = child.info.run_id
        client.log_param(run_id, "eval.num_speculative_tokens", str(k))
        client.log_metric(run_id, "evaluate/acceptance_length", 1.5 + job)
        for i in range(k):
            client.log_metric(run_id, f"evaluate/acceptance_pos_{i}", 0.5 / (i + 1))
        client.log_metric(run_id, "time/evaluate_s", 10.0)
        # What the job records from the evaluate stage's declared columns.
        metrics = {"acceptance_length": 1.5 + job}
        metrics.update(acceptance_length_ci_low=1.4 + job, acceptance_length_ci_high=1.6 + job)
        metrics.update({f"acceptance_pos_{i}": 0.5 / (i + 1) for i in range(k)})
        client.set_tag(run_id, COLUMNS_TAG, json.dumps(evaluate_columns(metrics)))
        client.set_tag(run_id, OBJECTIVE_TAG, "acceptance_length")
        client.set_terminated(run_id)
    rows = comparison_rows(client, parent.info.run_id)
    positions = [c for c in rows[0] if c.startswith("acc_pos_")]
    assert positions == [f"acc_pos_{i}" for i in range(5)]
    assert [r["eval.num_speculative_tokens"] for r in rows] == ["3", "5"]
    assert rows[0]["acc_pos_3"] is None and rows[1]["acc_pos_4"] == pytest.approx(0.1)
    table = render_table(rows, width=None)  # every column (report --wide)
    assert "acc_pos_4" in table.splitlines()[0] and "sweep time 20 s" in table
    narrow = render_table(rows)  # the console's 120 columns, the rest named
    assert all(len(line) <= 120 for line in narrow.splitlines()[:4]) and "acc_pos_4" in narrow
    # The decision first: both ends of the objective's interval and vs_best fit the console,
    # and one line says which job is best and by how much.
    header = narrow.splitlines()[0]
    assert "acceptance_length_hi" in header and "vs_best" in header, header
    assert (
        "best: job 1 (eval.num_speculative_tokens=5): acceptance_length 2.500 (2.400-2.600); "
        "the rest below it"
    ) in narrow


def test_a_stopped_sweep_reports_its_time_and_why_each_job_ended(tmp_path):
    """A job killed mid-stage timed none of its stages: report shows its wall time and the
    reason its run recorded, not "sweep time 0 s" and nothing."""
    import time

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("eagle3", artifact_location=(tmp_path / "art").as_uri())
    params = json.dumps({"train.lr": "1e-3,2e-3"})
    parent = client.create_run(exp, tags={"sweep.config": "lr", "sweep.params": params})
    now = int(time.time() * 1000)
    for job, (status, failure) in enumerate(
        (("KILLED", "interrupted by SIGTERM during stage 'train'"), ("FAILED", None))
    ):
        tags = {"mlflow.parentRunId": parent.info.run_id, "sweep.job": str(job)}
        run = client.create_run(exp, start_time=now, tags=tags)
        client.log_param(run.info.run_id, "train.lr", ("1e-3", "2e-3")[job])
        if failure:
            client.set_tag(run.info.run_id, "failure", failure)
        client.set_terminated(run.info.run_id, status, end_time=now + 42_000)
    table = render_table(comparison_rows(client, parent.info.run_id))
    assert "job 0 KILLED: interrupted by SIGTERM during stage 'train'" in table, table
    assert "job 1 FAILED: failed" in table and "sweep time 84 s" in table, table


def test_a_divergence_at_a_near_tie_is_told_from_a_real_mismatch():
    from stages.evaluate.measures import MISMATCH, NEAR_TIE, UNKNOWN, divergence

    target = [5, 6, 7, 8]
    # The target's likeliest tokens per position, (id, logprob), likeliest first.
    top = [
        [(5, -0.1), (9, -3.0)],
        [(6, -0.70), (4, -0.82), (2, -0.95)],
        [(7, -0.2), (3, -2.0)],
        [(8, -1.0)],
    ]
    assert divergence(target, target, top, 0.25) is None
    near = divergence([5, 4, 1], target, top, 0.25)  # the runner-up, 0.12 below (one bf16 step)
    assert near["position"] == 1 and near["verdict"] == NEAR_TIE and abs(near["gap"] - 0.12) < 1e-9
    third = divergence([5, 2], target, top, 0.25)  # a three-way tie: the third, 0.25 below
    assert third["verdict"] == NEAR_TIE and abs(third["gap"] - 0.25) < 1e-9
    far = divergence([5, 6, 3], target, top, 0.25)  # the runner-up, 1.8 below: a real error
    assert far["position"] == 2 and far["verdict"] == MISMATCH and far["target_token"] == 7
    unranked = divergence([5, 6, 1], target, top, 0.25)  # not among the target's likeliest
    assert unranked["verdict"] == MISMATCH
    stopped = divergence([5, 6, 7], target, top, 0.25)  # the last position shows one token
    assert stopped["position"] == 3 and stopped["verdict"] == UNKNOWN


def test_a_gap_of_exactly_the_threshold_read_through_fp32_rounding_is_a_near_tie():
    from stages.evaluate.measures import MISMATCH, NEAR_TIE, divergence

    # The gap one H200 run read at humaneval prompt 54 (0.5000000596: one bf16 spacing, 0.5,
    # plus one fp32 spacing), between the target's choice and the served token, its runner-up.
    top = [[(3725, -0.6931471824645996), (198, -1.1931472420692444)]]
    near = divergence([198], [3725], top, 0.5)
    assert near["gap"] > 0.5 and near["verdict"] == NEAR_TIE
    # One bf16 spacing further (1.0 below) is outside a threshold of 0.5: a real mismatch.
    far = divergence([198], [3725], [[(3725, -0.2), (198, -1.2)]], 0.5)
    assert far["verdict"] == MISMATCH


def test_the_speed_ratio_pairs_repeats_and_reports_their_spread():
    from stages.evaluate.measures import speed_metrics

    m = speed_metrics(
        {"c1": [110.0, 100.0, 105.0], "batch": [900.0, 950.0, 925.0]},
        {"c1": [100.0, 100.0, 100.0], "batch": [1000.0, 1000.0, 1000.0]},
    )
    assert abs(m["speedup_c1"] - 1.05) < 1e-9 and abs(m["speedup_c1_std"] - 0.05) < 1e-9
    assert abs(m["speedup_batch"] - 0.925) < 1e-9 and m["target_tok_s_batch"] == 1000.0
    # The 95% interval: the ratio times/divided by exp(t(2) * sd / sqrt(3)) of the log ratios.
    import math
    import statistics

    logs = [math.log(r) for r in (1.10, 1.00, 1.05)]
    half = 4.302653 * statistics.stdev(logs) / math.sqrt(3)
    assert m["speedup_c1_ci_low"] == pytest.approx(1.05 * math.exp(-half), rel=1e-5)
    assert m["speedup_c1_ci_high"] == pytest.approx(1.05 * math.exp(half), rel=1e-5)
    # One repeat: a ratio, no interval.
    one = speed_metrics({"c1": [110.0], "batch": []}, {"c1": [100.0], "batch": []})
    assert "speedup_c1_ci_low" not in one and "speedup_batch" not in one


# Repeats on one H200, 2026-12-03 (tokens/s, eval.speed_servers=together, 5 timed passes of
# each server at batch 80): the stage's client, then the independent one on the same servers.
H200_BATCH = {
    "draft": [3738.3, 3631.5, 4346.5, 4039.9, 3362.8],
    "target": [11090.3, 13859.7, 10871.0, 14008.0, 12218.1],
    "draft_check": [4298.1, 3588.4, 3974.4, 3904.4, 6051.6],
    "target_check": [12961.6, 9554.8, 10932.0, 14178.7, 11143.6],
}


def test_a_speed_check_miss_inside_both_measurements_noise_is_told_apart_from_a_fault(tmp_path):
    from runner.core.schema import typed
    from stages.evaluate.measures import paired_noise, speed_metrics
    from stages.evaluate.report import summary
    from stages.evaluate.speed_check import agreement
    from tests.conftest import compose

    h = H200_BATCH
    ours = speed_metrics({"c1": [], "batch": h["draft"]}, {"c1": [], "batch": h["target"]})
    theirs = speed_metrics(
        {"c1": [], "batch": h["draft_check"]}, {"c1": [], "batch": h["target_check"]}
    )
    speeds = {
        s: {"c1": [], "batch": h[s], "check": {"c1": [], "batch": h[f"{s}_check"]}}
        for s in ("draft", "target")
    }
    noise = paired_noise(speeds)
    assert set(noise) == {"batch"}  # no concurrency-1 repeats, no noise for them
    half = noise["batch"]
    got = agreement({"batch": ours["speedup_batch"]}, {"batch": theirs["speedup_batch"]}, noise)
    # 0.306x against 0.357x: 14% apart, more than 10%, but each ratio's interval is about ±20%.
    assert got["speed_check_agrees"] == 0 and got["speed_check_batch_within_noise"] == 1
    assert round(got["speed_check_batch_diff"], 3) == -0.142
    assert 0.3 < got["speed_check_batch_noise"] < 0.6
    # The same stage ratio against a check 40% higher than it, with the same noise: a fault.
    fault = agreement({"batch": 0.306}, {"batch": 0.306 * 1.9}, {"batch": half})
    assert fault["speed_check_batch_within_noise"] == 0
    cfg = typed(compose(["hardware=gpu1", "run.output_root=unused"]))
    base = {"acceptance_length": 1.5, "speed_repeats": 5, "speed_batch": 80, **ours}
    base |= {"acceptance_length_ci_low": 1.45, "acceptance_length_ci_high": 1.55, "prompts": 80}
    base |= {"speedup_c1": 0.57, "speedup_c1_std": 0.08}
    line = next(x for x in summary({**base, **got}, tmp_path, cfg) if x.startswith("speed checked"))
    assert "within the two measurements' own noise" in line and "eval.speed_repeats" in line
    speed = next(x for x in summary({**base, **got}, tmp_path, cfg) if x.startswith("speed, warm"))
    assert "0.31x ± 0.06 (95% 0.25-0.38) at batch 80" in speed
    # ... beside the acceptance length's own interval over prompts.
    first = summary({**base, **got}, tmp_path, cfg)[0]
    assert first.startswith("acceptance length 1.500 on mtbench (95% interval 1.450-1.550 over 80")
    line = next(
        x for x in summary({**base, **fault}, tmp_path, cfg) if x.startswith("speed checked")
    )
    assert "SPEED CHECK DISAGREES, by more than the two measurements' own noise" in line


def test_timings_side_by_side_cancel_a_level_both_clients_see():
    """One H200 on 2026-12-04: the draft's server at concurrency 1 moved between about 255
    and 335 tok/s. When both clients time each repeat side by side they meet the same level, and
    the paired noise is the clients' own disagreement (2% here), not the server's levels (an
    interval of about ±25% per ratio)."""
    import math

    from stages.evaluate.measures import paired_noise, speed_metrics
    from stages.evaluate.speed_check import agreement

    level = [255.0, 335.0, 335.0, 255.0, 335.0]
    target = [438.0, 470.0, 410.0, 450.0, 430.0]
    wobble = [1.01, 0.99, 1.02, 0.98, 1.0]  # the check's own per-repeat error
    speeds = {
        "draft": {"c1": level, "batch": [], "check": {"c1": level, "batch": []}},
        "target": {
            "c1": target,
            "batch": [],
            "check": {"c1": [t * w for t, w in zip(target, wobble, strict=True)], "batch": []},
        },
    }
    noise = paired_noise(speeds)
    assert math.exp(noise["c1"]) - 1 < 0.03
    ours = speed_metrics({"c1": level, "batch": []}, {"c1": target, "batch": []})
    assert ours["speedup_c1_ci_high"] / ours["speedup_c1_ci_low"] > 1.3  # each ratio: wide
    theirs = speed_metrics(speeds["draft"]["check"], speeds["target"]["check"])
    got = agreement({"c1": ours["speedup_c1"]}, {"c1": theirs["speedup_c1"]}, noise)
    assert got["speed_check_agrees"] == 1 and got["speed_check_c1_within_noise"] == 1


def test_the_speed_check_flags_a_ratio_more_than_ten_percent_off_the_second_measurement(tmp_path):
    from runner.core.schema import typed
    from stages.evaluate.report import summary
    from stages.evaluate.speed_check import agreement
    from tests.conftest import compose

    close = agreement({"c1": 0.50, "batch": 0.30}, {"c1": 0.52, "batch": 0.32})
    assert close["speed_check_agrees"] == 1
    assert abs(close["speed_check_c1_diff"] - (0.50 / 0.52 - 1)) < 1e-12
    # One H200 on 2026-12-02: the stage 25% and 29% below the probe.
    far = agreement({"c1": 0.46, "batch": 0.30}, {"c1": 0.62, "batch": 0.42})
    assert far["speed_check_agrees"] == 0 and far["speed_check_batch"] == 0.42
    # The summary says which is which, and names a disagreement.
    metrics = {
        "acceptance_length": 1.5,
        "speedup_c1": 0.46,
        "speedup_c1_std": 0.02,
        "speedup_batch": 0.30,
        "speedup_batch_std": 0.03,
        "speed_repeats": 5,
        "speed_batch": 80,
        **far,
        "draft_compile_cold": 1,
        "target_compile_cold": 0,
        "speed_servers_together": 1,
    }
    cfg = typed(compose(["hardware=gpu1", "run.output_root=unused"]))
    lines = summary(metrics, tmp_path, cfg)  # (no manifest: the serve line says where to look)
    check = next(line for line in lines if line.startswith("speed checked"))
    assert "0.62x at concurrency 1 (-26%)" in check and "0.42x at batch (-29%)" in check
    assert "SPEED CHECK DISAGREES" in check
    speed = next(line for line in lines if line.startswith("speed, warm"))
    assert "both servers up, passes alternating" in speed
    assert "compiled: draft-served cold, target cached" in speed


def test_two_servers_side_by_side_take_half_the_memory_and_alternate_their_passes():
    from runner.core.schema import typed
    from stages.evaluate.serving import TOGETHER_WEIGHTS_SHARE, alternating, halved, together
    from tests.conftest import compose

    args = ["--gpu-memory-utilization", "0.85", "--kv-cache-memory-bytes", "1073741824", "--x"]
    assert halved(args) == [
        "--gpu-memory-utilization",
        "0.425",
        "--kv-cache-memory-bytes",
        "536870912",
        "--x",
    ]
    assert alternating(["draft", "target"], 3) == [
        ["draft", "target"],
        ["target", "draft"],
        ["draft", "target"],
    ]
    gpu = typed(compose(["hardware=gpu1", "run.output_root=unused"]))
    gib = 1 << 30
    assert together(gpu, 0.3 * gib, 141.0)[0]  # a 135M target on an H200
    assert not together(gpu, TOGETHER_WEIGHTS_SHARE * 141 * gib * 1.01, 141.0)[0]
    assert not together(gpu, 0.3 * gib, None)[0]  # memory not known: apart
    kimi = typed(compose(["model=kimi_k25", "hardware=blackwell8", "run.output_root=unused"]))
    assert not together(kimi, 75 * gib, 96.0)[0]  # 1T parameters at TP 8: one at a time
    forced = typed(compose(["hardware=gpu1", "eval.speed_servers=apart", "run.output_root=u"]))
    assert together(forced, 0.3 * gib, 141.0) == (False, "eval.speed_servers=apart")


def test_the_sweep_figure_does_not_zoom_a_small_difference_into_a_cliff():
    """Acceptance 1.11 against 1.12 on a y axis from zero, not from 1.11."""
    import matplotlib.pyplot as plt

    from runner.tracking.sweep import comparison_figure

    rows = [
        {"preset": p, "acceptance_length": v, "vocab": "4096"}
        for p, v in (("early", 1.11), ("late", 1.12))
    ]
    fig = comparison_figure(rows, "acceptance_length", ("preset", "capture preset", "vocab"))
    low, high = fig.axes[0].get_ylim()
    plt.close(fig)
    assert low == 0.0 and 1.12 < high < 1.3


def test_the_sweep_figure_shows_each_jobs_interval_and_the_line_of_nothing_accepted():
    import matplotlib.pyplot as plt

    from runner.tracking.sweep import comparison_figure

    rows = [
        {"k": k, "acceptance_length": v, "acceptance_length_lo": lo, "acceptance_length_hi": hi}
        for k, v, lo, hi in ((3, 1.40, 1.31, 1.52), (5, 1.45, 1.30, 1.61))
    ]
    axis = ("k", "eval.num_speculative_tokens", None)
    fig = comparison_figure(rows, "acceptance_length", axis, (1.0, "1.0: nothing accepted"))
    ax = fig.axes[0]
    bars = [c for c in ax.containers if type(c).__name__ == "ErrorbarContainer"]
    (segments,) = [c.get_segments() for c in ax.collections]
    labels = ax.get_legend_handles_labels()[1]
    _, high = ax.get_ylim()
    plt.close(fig)
    assert len(bars) == 1 and any("(95% interval)" in label for label in labels)
    # One bar per job, from its low end to its high end.
    assert sorted((s[0][1], s[1][1]) for s in segments) == [(1.30, 1.61), (1.31, 1.52)]
    assert any(label.startswith("1.0") for label in labels) and high > 1.61


# The field's gains on 8x RTX PRO 6000 with Kimi and a public draft at k=3 (draft-served and
# target-alone aggregate tokens/s by closed-loop streams; vLLM #40608).
FIELD = {1: (114.1, 88.5), 16: (659.0, 475.0), 64: (1522.0, 1330.0), 128: (1992.0, 2026.0)}


def test_the_gain_by_concurrency_has_per_stream_rates_and_its_crossover():
    from stages.evaluate.measures import by_concurrency, crossover, speed_metrics

    # Three repeats per level, each within 1% of the field's figure.
    draft = {f"c{n}": [d * 0.99, d, d * 1.01] for n, (d, _) in FIELD.items()}
    target = {f"c{n}": [t, t * 1.01, t * 0.99] for n, (_, t) in FIELD.items()}
    rows = by_concurrency(speed_metrics(draft, target), [1, 16, 64, 128])
    assert [r["concurrency"] for r in rows] == [1, 16, 64, 128]
    assert [round(r["gain"], 2) for r in rows] == [1.29, 1.39, 1.14, 0.98]
    assert rows[1]["draft_tok_s_per_stream"] == pytest.approx(659.0 / 16)
    assert all(r["gain_ci_low"] < r["gain"] < r["gain_ci_high"] for r in rows)
    found = crossover(rows)
    assert found["speed_crossover"] == 128 and found["speed_pays_up_to"] == 64
    # 0.98 with repeats 2% apart: its interval reaches above 1, so the crossover is not certain.
    assert found["speed_crossover"] and not found["speed_crossover_certain"]
    # A draft that pays everywhere has no crossover.
    assert "speed_crossover" not in crossover(rows[:3])


def test_the_kv_capacity_is_read_from_vllms_own_start_up_line():
    from runner.serving.vllm_server import kv_capacity

    gpu = (
        "(EngineCore_DP0 pid=1) INFO 12-06 [kv_cache_utils.py:1087] GPU KV cache size: "
        "1,770,000 tokens, Maximum concurrency for 4,096 tokens per request: 432.13x\n"
    )
    assert kv_capacity("noise\n" + gpu) == {
        "kv_cache_tokens": 1770000,
        "kv_tokens_per_request": 4096,
        "kv_max_concurrency": 432.13,
    }
    cpu = gpu.replace("GPU", "CPU").replace("1,770,000", "45,006")
    # Two engine cores: the smaller is what each can hold.
    assert kv_capacity(gpu + cpu)["kv_cache_tokens"] == 45006
    assert kv_capacity("no such line") is None
    # vLLM 0.26 (the CUDA build checked) says it in two lines (one H100, 2026-12-06).
    two = (
        "INFO 12-06 06:45:31 [kv_cache_utils.py:2177] GPU KV cache size: 1,482,223 tokens\n"
        "INFO 12-06 06:45:31 [kv_cache_utils.py:2178] Maximum concurrency for 2,048 tokens per "
        "request: 723.74x\n"
    )
    assert kv_capacity(two) == {
        "kv_cache_tokens": 1482223,
        "kv_tokens_per_request": 2048,
        "kv_max_concurrency": 723.74,
    }
