"""A CPU run's time (runner/engine/budget.py): each stage's estimate from the machine's measured
speed, and run.time_budget sizing data.num_samples so that the whole estimate fits; what was
given on the command line is kept; GPU runs are not sized."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from runner.assets.target_facts import resolve_target
from runner.core.layout import RunLayout
from runner.core.schema import typed
from runner.engine.budget import FIXED_SHARE, MIN_ROWS, ROWS_STEP, estimate, fit_budget
from runner.engine.cpu_speed import MachineSpeed, probe
from stages import REGISTRY
from tests.conftest import compose, run_job, tiny_overrides


def speed(gflops: float) -> MachineSpeed:
    return MachineSpeed("float32", 2, "a test CPU", gflops, gflops, gflops, 0.0)


@pytest.fixture
def setup(tiny_model_dir, chats_jsonl, tmp_path):
    def make(*extra: str):
        over = tiny_overrides(
            tiny_model_dir, chats_jsonl, tmp_path, "model.capture_layers=[0,2,3]", *extra
        )
        cfg = typed(compose([o for o in over if not o.startswith("run.stages")]))
        return cfg, resolve_target(cfg, Path(cfg.run.output_root))

    return make


def test_every_cpu_stage_estimates_and_a_faster_machine_estimates_less(setup):
    cfg, target = setup("data.num_samples=400", "train.max_steps=null")
    slow = estimate(cfg, target, REGISTRY, None, speed=speed(1.0))
    fast = estimate(cfg, target, REGISTRY, None, speed=speed(4.0))
    assert set(slow) == {"prepare", "extract", "train", "evaluate"}
    for stage in ("extract", "train"):  # their products scale with the rate
        assert fast[stage] < slow[stage]
    more = estimate(cfg, target, REGISTRY, None, rows=800, speed=speed(1.0))
    assert more["extract"] > slow["extract"] and more["train"] > slow["train"]
    assert more["evaluate"] == slow["evaluate"]  # the prompts, not the rows


def test_the_budget_takes_the_most_rows_that_fit_and_says_what_it_cost(setup):
    cfg, target = setup("data.num_samples=2000", "train.max_steps=null", "run.time_budget=1")
    rate = speed(0.05)

    def total(rows: int) -> float:
        return sum(estimate(cfg, target, REGISTRY, None, rows=rows, speed=rate).values())

    lean = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, num_prompts=20))
    low, high = (
        sum(estimate(lean, target, REGISTRY, None, rows=n, speed=rate).values())
        for n in (MIN_ROWS, 2000)
    )
    budget = (low + high) / 2  # room for more than the fewest rows, not for all of them
    cfg.run.time_budget = budget / 60
    sized, lines = fit_budget(cfg, target, REGISTRY, None, speed=rate)
    rows = sized.data.num_samples
    assert MIN_ROWS < rows < 2000 and rows % ROWS_STEP == 0

    def sized_total(n: int) -> float:  # with the evaluation as the budget left it
        return sum(estimate(sized, target, REGISTRY, None, rows=n, speed=rate).values())

    assert sized_total(rows) <= budget < sized_total(rows + ROWS_STEP)
    # The evaluation, which the rows do not size, took at most its share in fewer prompts.
    ev = [s for s in REGISTRY if s.name == "evaluate"]
    assert sized.eval.num_prompts < cfg.eval.num_prompts
    spent = estimate(sized, target, ev, None, speed=rate)["evaluate"]
    assert spent <= FIXED_SHARE * budget or sized.eval.num_prompts == 20  # or its floor
    assert any(f"{sized.eval.num_prompts} prompts a set instead of 80" in x for x in lines)
    assert cfg.data.num_samples == 2000  # the given config is left as it was
    assert "2,000 rows would take" in lines[0] and f"using {rows:,} rows" in lines[0]
    # Given on the command line, the sizing keys are kept, and the estimate said.
    kept, lines = fit_budget(cfg, target, REGISTRY, None, {"data.num_samples"}, speed=rate)
    assert kept.data.num_samples == 2000 and "kept as given (data.num_samples)" in lines[0]
    # A budget the full size fits changes nothing.
    cfg.run.time_budget = total(2000) / 60 + 1
    same, lines = fit_budget(cfg, target, REGISTRY, None, speed=rate)
    assert same.data.num_samples == 2000 and lines == []
    # A run smaller than the fewest rows the budget sizes to keeps its own, however slow.
    small = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, num_samples=60))
    small.run.time_budget = 0.01
    assert fit_budget(small, target, REGISTRY, None, speed=rate)[0].data.num_samples == 60
    # Off, and on a GPU: not sized.
    cfg.run.time_budget = None
    assert fit_budget(cfg, target, REGISTRY, None, speed=rate) == (cfg, [])


def test_the_probe_measures_this_cpu_in_the_runs_format():
    got = probe("float32", 1, 64, 128, 256)
    assert got.threads == 1 and got.dtype == "float32"
    assert min(got.target_gflops, got.draft_gflops, got.gram_gflops) > 0.01
    assert got.probe_s < 10


def test_the_plan_shows_the_machine_the_estimates_and_records_them(
    tiny_model_dir, chats_jsonl, tmp_path
):
    over = tiny_overrides(
        tiny_model_dir, chats_jsonl, tmp_path, "model.capture_layers=[0,2,3]", "run.plan_only=true"
    )
    plan = run_job(compose(over)).plan
    text = plan.render()
    assert "this machine" in text and "GFLOP/s" in text and "estimate here" in text
    assert "number format" in text
    for stage in ("prepare", "extract", "train"):
        assert plan.numbers[f"estimate.{stage}_s"] > 0
    speeds = RunLayout(tmp_path).cache / "cpu_speed.json"
    assert speeds.is_file()  # measured once: the next plan on this machine reads it back


def test_report_shows_each_estimate_beside_its_measured_time():
    from runner.commands.report import estimate_lines

    lines = estimate_lines(
        {
            "time/extract_s": 200.0,
            "time/extract_estimate_s": 150.0,
            "time/train_s": 400.0,
            "time/train_estimate_s": 440.0,
            "time/vocab_s": 0.3,
        }
    )
    assert "estimated against measured" in lines[0]
    assert lines[2].split() == ["extract", "150s", "200s", "-25%"]
    assert lines[3].split() == ["train", "440s", "400s", "+10%"]
    assert estimate_lines({"time/train_s": 400.0}) == []
