"""The stage contract: the registry is the one list of stages, the engine names none (no stage
name, no stage's config section, no stage's metric name), and a new stage, settings included,
is one module plus one registry line (proved by adding one here, injected as the composition
root injects the registry)."""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import pytest

from runner.core.errors import ConfigError
from runner.core.schema import register
from runner.engine.stage import Stage, StageContext, check_registry
from runner.tracking.sweep import PARENT_ENV, comparison_rows
from stages import REGISTRY
from stages.extract.settings import EXTRACT_BACKENDS
from tests.conftest import REPO, compose, run_job, tiny_overrides

# The engine: the modules that run any stage and must never name one, by room (runner/engine,
# runner/tracking), and the store and the companions that read any run's stages.
ENGINE = sorted(
    str(p.relative_to(REPO / "runner").with_suffix(""))
    for p in [
        *(REPO / "runner" / "engine").glob("*.py"),
        *(REPO / "runner" / "tracking").glob("*.py"),
        REPO / "runner" / "core" / "store.py",
        REPO / "runner" / "commands" / "report.py",
        REPO / "runner" / "commands" / "publish.py",
    ]
    if p.name != "__init__.py"
)
# Config sections that belong to one stage: the engine never reads them (`cfg.eval.x`).
STAGE_SECTIONS = ("data", "regenerate", "extract", "train", "eval")
# Metric names stages produce: the engine reads them only through declarations.
METRIC_NAMES = ("acceptance_length", "val_loss", "draft_vocab_size", "acceptance_pos_")


def stage_names() -> tuple[str, ...]:
    return tuple(s.name for s in REGISTRY)


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


def test_the_engine_list_holds_the_rooms():
    assert {"engine/job", "engine/pipeline", "engine/stage", "tracking/sweep"} <= set(ENGINE)


@pytest.mark.parametrize("module", ENGINE)
def test_the_engine_names_no_stage(module):
    names = set(stage_names())
    hits = [
        (line, s)
        for line, s in _string_literals(REPO / "runner" / f"{module}.py")
        if s in names or any(s.startswith(f"{n}/") for n in names)
    ]
    assert not hits, f"runner/{module}.py names stages: {hits}"


def _section_reads(path: Path) -> list[tuple[int, str]]:
    """`cfg.<section>` / `view.cfg.<section>` attribute reads of a stage's own section."""
    tree = ast.parse(path.read_text())
    return [
        (node.lineno, node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in STAGE_SECTIONS
        and (
            (isinstance(node.value, ast.Name) and node.value.id == "cfg")
            or (isinstance(node.value, ast.Attribute) and node.value.attr == "cfg")
        )
    ]


@pytest.mark.parametrize(
    "module",
    [
        "engine/job",
        "engine/pipeline",
        "engine/preflight",
        "engine/stage",
        "engine/checks",
        "tracking/sweep",
    ],
)
def test_the_engine_reads_no_stage_section_and_no_metric_name(module):
    path = REPO / "runner" / f"{module}.py"
    reads = _section_reads(path)
    assert not reads, f"runner/{module}.py reads stage sections: {reads}"
    metrics = [(n, s) for n, s in _string_literals(path) if any(m in s for m in METRIC_NAMES)]
    assert not metrics, f"runner/{module}.py names stage metrics: {metrics}"


def test_a_stage_must_come_after_what_it_reads():
    late = Stage(name="late", key_config=lambda c, f: {}, run=lambda ctx: {}, upstream=("nope",))
    with pytest.raises(ValueError, match="late reads"):
        check_registry((*REGISTRY, late))


# A stage written the way the real ones are, with settings of its own: a section `count` with a
# key that enters its store key, a check, a metric that becomes a sweep column and the plotted
# one, a summary line and a plan line.
@dataclass
class CountSettings:
    # Rows shorter than this many tokens are not counted.
    min_tokens: int = 1

    def check(self) -> None:
        if self.min_tokens < 1:
            raise ConfigError("count.min_tokens", f"{self.min_tokens} must be >= 1")


def _count_key(cfg, facts) -> dict[str, Any]:
    return {"tokenizer": facts.tokenizer_id, "min_tokens": cfg.count.min_tokens}


def _count_run(ctx: StageContext) -> dict[str, Any]:
    import datasets

    rows = datasets.load_from_disk(str(ctx.inputs["prepare"].path / "dataset")).with_format(None)
    long = [n for n in rows["seq_len"] if n >= ctx.cfg.count.min_tokens]
    counts = {"rows": len(long), "longest": max(rows["seq_len"])}
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
    settings=CountSettings,
    logged={"count.json": "count"},
    summary=lambda m, path, cfg: [f"counted {m['rows']} rows"],
    columns=_count_columns,
    plotted="counted_rows",
    plan=lambda plan, view: plan.add("count", f"rows of >= {view.cfg.count.min_tokens} tokens"),
)


@pytest.fixture
def with_count():
    """The registry with COUNT after prepare (which it reads), its schema composed on."""
    at = [s.name for s in REGISTRY].index("prepare") + 1
    stages = (*REGISTRY[:at], COUNT, *REGISTRY[at:])
    register(stages)
    yield stages
    register(REGISTRY)


def test_a_config_is_typed_by_the_schema_it_was_composed_on(with_count):
    """No schema is remembered between compositions: a config composed with COUNT's section is
    typed with it after the registry without COUNT is registered again, and the other way."""
    from runner.core.schema import typed

    with_it = compose(["count.min_tokens=4"])
    register(REGISTRY)
    without = compose([])
    assert typed(with_it).count.min_tokens == 4
    assert not hasattr(typed(without), "count")
    with pytest.raises(ConfigError, match=r"count"):
        typed(compose(["+count.min_tokens=4"]))


def test_a_new_stage_with_settings_is_one_module_and_one_registry_line(
    monkeypatch, with_count, tiny_model_dir, chats_jsonl, tmp_path, capsys
):
    stages = with_count
    overrides = tiny_overrides(
        tiny_model_dir,
        chats_jsonl,
        tmp_path,
        "model.capture_layers=[1,2,3]",
        "run.stages=[prepare,count]",
        "count.min_tokens=2",
    )
    # Its settings are checked with the others, naming the key.
    with pytest.raises(ConfigError, match=r"count\.min_tokens"):
        run_job(compose([*overrides, "count.min_tokens=0"]), stages)
    with pytest.raises(ConfigError, match=r"count\.nope"):
        run_job(compose([*overrides, "+count.nope=1"]), stages)
    first = run_job(compose(overrides), stages)
    assert first.stages == {"prepare": "computed", "count": "computed"}  # extract etc. not needed
    out = capsys.readouterr().out
    assert "prepare:run, count:run" in out and "rows of >= 2 tokens" in out
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
    again = run_job(compose([*overrides, "run.force=[count]"]), stages)
    assert again.stages == {"prepare": "cached", "count": "computed"}
    (row,) = comparison_rows(client, parent)
    assert row["counted_rows"] == rows and row["computed"] == "count"
    assert client.get_run(again.run_id).data.params["count.min_tokens"] == "2"
    # A new setting is a new key: computed again; the same one is cached.
    other = run_job(compose([*overrides[:-1], "count.min_tokens=3"]), stages)
    assert other.stages == {"prepare": "cached", "count": "computed"}
    assert run_job(compose(overrides), stages).stages["count"] == "cached"
