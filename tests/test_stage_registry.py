"""The stage contract: the registry is the one list of stages, the engine names none, and a new
stage is one module plus one registry line (proved by adding one here)."""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlflow
import pytest

import stages
from runner.job import run_job
from runner.schema import EXTRACT_BACKENDS
from runner.stage import Stage, StageContext, registry, stage_names
from runner.sweep import PARENT_ENV, comparison_rows
from tests.conftest import REPO, compose, tiny_overrides

# The engine: these modules run any stage and must never name one.
ENGINE = ["job", "pipeline", "preflight", "sweep", "report", "stage", "checks", "store", "tracking"]


def test_registry_lists_every_stage_module_in_pipeline_order():
    assert stage_names() == ("regenerate", "prepare", "extract", "vocab", "train", "evaluate")
    modules = {p.stem for p in (REPO / "stages").glob("*.py") if p.stem != "__init__"}
    modules |= {p.parent.name for p in (REPO / "stages").glob("*/__init__.py")}
    assert modules == set(stage_names())  # stages/ holds stages only
    for name in EXTRACT_BACKENDS:  # one module per extraction backend
        assert (REPO / "stages" / "extract" / f"{name}_backend.py").is_file(), name


def _string_literals(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


@pytest.mark.parametrize("module", ENGINE)
def test_the_engine_names_no_stage(module):
    names = set(stage_names())
    hits = [
        (line, s)
        for line, s in _string_literals(REPO / "runner" / f"{module}.py")
        if s in names or any(s.startswith(f"{n}/") for n in names)
    ]
    assert not hits, f"runner/{module}.py names stages: {hits}"


def test_a_stage_must_come_after_what_it_reads(monkeypatch):
    late = Stage(name="late", key_config=lambda c, f: {}, run=lambda ctx: {}, upstream=("nope",))
    monkeypatch.setattr(stages, "REGISTRY", (*stages.REGISTRY, late))
    with pytest.raises(ValueError, match="late reads"):
        registry()


# A stage written the way the real ones are: key, run, logged files, summary, column, plan line.
def _count_key(cfg, facts) -> dict[str, Any]:
    return {"tokenizer": facts.tokenizer_id, "min": 1}


def _count_run(ctx: StageContext) -> dict[str, Any]:
    import datasets

    rows = datasets.load_from_disk(str(ctx.inputs["prepare"].path / "dataset")).with_format(None)
    counts = {"rows": len(rows), "longest": max(rows["seq_len"])}
    (ctx.out / "count.json").write_text(json.dumps(counts))
    return counts


def _count_columns(metrics: Mapping[str, float]) -> dict[str, float | None]:
    return {"counted_rows": metrics.get("rows")}


COUNT = Stage(
    name="count",
    key_config=_count_key,
    run=_count_run,
    upstream=("prepare",),
    identities=("tokenizer_id",),
    logged={"count.json": "count"},
    summary=lambda m, path, cfg: [f"counted {m['rows']} rows"],
    columns=_count_columns,
    plan=lambda plan, view: plan.add("count", "rows of the prepared data"),
)


def test_a_new_stage_is_one_module_and_one_registry_line(
    monkeypatch, tiny_model_dir, chats_jsonl, tmp_path, capsys
):
    # The registry line: after prepare, which it reads.
    at = [s.name for s in stages.REGISTRY].index("prepare") + 1
    monkeypatch.setattr(stages, "REGISTRY", (*stages.REGISTRY[:at], COUNT, *stages.REGISTRY[at:]))
    overrides = tiny_overrides(
        tiny_model_dir,
        chats_jsonl,
        tmp_path,
        "model.capture_layers=[1,2,3]",
        "run.stages=[prepare,count]",
    )
    first = run_job(compose(overrides))
    assert first.stages == {"prepare": "computed", "count": "computed"}  # extract etc. not needed
    out = capsys.readouterr().out
    assert "prepare:run, count:run" in out and "rows of the prepared data" in out
    rows = first.results["prepare"].metrics["rows"]
    assert f"counted {rows} rows" in out
    assert json.loads((first.results["count"].path / "count.json").read_text())["rows"] == rows

    client = mlflow.MlflowClient(first.tracking_uri)
    run = client.get_run(first.run_id)
    assert run.data.metrics["count/rows"] == rows and run.data.tags["stage.count"] == "computed"
    assert [a.path for a in client.list_artifacts(first.run_id, "count")] == ["count/count.json"]

    # As a sweep job, forced: it recomputes, and its column reaches the comparison.
    parent = client.create_run(run.info.experiment_id, tags={"sweep.params": "{}"}).info.run_id
    monkeypatch.setenv(PARENT_ENV, parent)
    again = run_job(compose([*overrides, "run.force=[count]"]))
    assert again.stages == {"prepare": "cached", "count": "computed"}
    (row,) = comparison_rows(client, parent)
    assert row["counted_rows"] == rows and row["computed"] == "count"
