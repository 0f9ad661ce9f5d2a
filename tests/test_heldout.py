"""The held-out prompt set (`heldout` in eval.prompts): conversations of the training data that
prepare never read, each up to its last user turn that fits (multi-turn where the chat template
allows), chosen after a real prepare run."""

from __future__ import annotations

import json

import pytest
from datasets import load_from_disk
from transformers import AutoTokenizer

from runner.assets.chat import render
from runner.assets.prompts import messages, shown, user_turns
from runner.core.errors import ConfigError, StageError
from runner.core.schema import typed
from stages.evaluate.heldout import consumed, heldout_prompts
from stages.evaluate.prompt_sets import fits_in
from tests.conftest import compose, run_job, tiny_overrides

# SmolLM2's own template, less than it allows: one user turn only, as some targets' templates.
ONE_TURN_TEMPLATE = (
    "{% if messages | selectattr('role', 'equalto', 'user') | list | length > 1 %}"
    "{{ raise_exception('this template takes one user turn') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    """40 conversations, each user turn unique, so that a prompt can be looked for in the rows;
    every third has a second exchange."""
    path = tmp_path_factory.mktemp("q") / "questions.jsonl"
    with open(path, "w") as fh:
        for i in range(40):
            turns = [
                {"role": "user", "content": f"What is question number {i} about?"},
                {"role": "assistant", "content": f"Question {i} is about the number {i}."},
            ]
            if i % 3 == 0:
                turns += [
                    {"role": "user", "content": f"And what follows question {i}?"},
                    {"role": "assistant", "content": f"Question {i + 1} follows it."},
                ]
            fh.write(json.dumps({"id": i, "messages": turns}) + "\n")
    return path


def test_the_heldout_prompts_are_conversations_prepare_never_read(
    tiny_model_dir, questions, tmp_path
):
    over = tiny_overrides(
        tiny_model_dir,
        questions,
        tmp_path,
        "model.capture_layers=[0,2,3]",
        "run.stages=[prepare]",
        samples=10,
    )
    cfg = compose(over)
    prepared = run_job(cfg).results["prepare"]
    manifest = json.loads((prepared.path / "manifest.json").read_text())
    used = consumed(manifest, None)
    assert used >= 10
    typed_cfg = typed(cfg)
    prompts = heldout_prompts(typed_cfg, 8, used)
    firsts = [messages(p)[0]["content"] for p in prompts]
    assert len(prompts) == len(set(firsts)) == 8
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    rows = load_from_disk(str(prepared.path / "dataset"))
    trained = "\n".join(tok.decode(ids) for ids in rows["input_ids"])
    for p in prompts:
        assert all(m["content"] not in trained for m in messages(p)), p
    # A conversation with a second exchange is asked its second question, after the data's own
    # first answer; the others their only one, as a plain user turn.
    multi = [p for p in prompts if user_turns(p) > 1]
    assert multi and all(not isinstance(p, str) for p in multi)
    for p in multi:
        assert [m["role"] for m in p] == ["user", "assistant", "user"]
        assert p[2]["content"].startswith("And what follows") and shown(p, 300).startswith(
            "[user turn 2] And what follows"
        )
    assert all(isinstance(p, str) for p in prompts if p not in multi)
    # What training read is never offered, however many prompts are asked for: fewer come, with a
    # warning; a run that read everything has none and says which key to change.
    assert len(heldout_prompts(typed_cfg, 100, used)) == 40 - used
    with pytest.raises(StageError, match=r"data\.num_samples"):
        heldout_prompts(typed_cfg, 8, 40)
    # A prompt that does not fit the evaluation's context is passed over, not sent; a conversation
    # too long whole is asked an earlier question.
    short = heldout_prompts(typed_cfg, 8, used, fits=lambda p: "number 3" not in str(p))
    assert all("number 3" not in str(p) for p in short) and len(short) == 8
    room = heldout_prompts(typed_cfg, 8, used, fits=lambda p: isinstance(p, str))
    assert [messages(p)[0]["content"] for p in room] == firsts
    # The chat template decides: one that takes a single user turn gets first turns only; with
    # SmolLM2's own, the evaluation's room decides.
    one_turn = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    one_turn.chat_template = ONE_TURN_TEMPLATE
    only_first = heldout_prompts(typed_cfg, 8, used, fits_in(one_turn, {}, 2048))
    assert [messages(p)[0]["content"] for p in only_first] == firsts
    assert all(isinstance(p, str) for p in only_first)
    assert heldout_prompts(typed_cfg, 8, used, fits_in(tok, {}, 2048)) == prompts
    longest = max(len(render(tok, messages(p), True, {})) for p in multi)
    cut = heldout_prompts(typed_cfg, 8, used, fits_in(tok, {}, longest - 1))
    assert [messages(p)[0]["content"] for p in cut] == firsts and cut != prompts


def test_with_regenerate_the_bound_is_what_regenerate_read():
    manifest = {"sources": [{"conversations_read": 12}]}
    assert consumed(manifest, None) == 12
    metrics = {"conversations": 14, "conversations_failed": 1, "skipped": {"prompt_too_long": 2}}
    assert consumed(manifest, metrics) == 17


def test_the_held_out_room_is_kept_by_prepare_and_checked_by_the_plan(
    tiny_model_dir, questions, tmp_path
):
    """data.hold_out conversations at the end of the order are never read for training, however
    many rows are asked or dropped, so no stage can use them up after the plan said yes. The
    plan refuses a room of none, or one that takes the whole source, and says what a room
    smaller than eval.num_prompts, or a source shorter than asked, will give."""
    every = "run.stages=[prepare,extract,vocab,train,evaluate]"

    def over(samples: int, *extra: str) -> list[str]:
        return tiny_overrides(
            tiny_model_dir,
            questions,
            tmp_path,
            "model.capture_layers=[0,2,3]",
            "eval.prompts=[heldout]",
            "eval.num_prompts=8",
            "data.hold_out=10",
            every,
            *extra,
            samples=samples,
        )

    def planned(samples: int, *extra: str) -> str:
        return run_job(compose(over(samples, *extra, "run.plan_only=true"))).plan.render()

    # 35 of 40 asked, 10 kept: prepare may read 30, which the plan says.
    assert "WARNING  data.num_samples: 35 rows asked of questions, but only 30 of the 30" in (
        planned(35)
    )
    # A row length that drops conversations (those of two-digit questions, 39 prompt tokens,
    # leave no room for 4 answer tokens in 42): counted in order in what prepare may read.
    short = planned(30, "data.max_seq_len=42")
    assert "WARNING  data.num_samples" in short and "data.max_seq_len=42" in short
    # A room smaller than the prompts asked gives fewer: said, not refused.
    assert "WARNING  data.hold_out: the held-out set has room for 10 prompts" in planned(
        20, "eval.num_prompts=12"
    )
    # No room, or all of it: refused, naming data.hold_out.
    for room, said in (("0", "0 conversations kept"), ("40", "all 40 usable conversations")):
        with pytest.raises(ConfigError) as refused:
            planned(20, f"data.hold_out={room}")
        assert refused.value.key == "data.hold_out" and said in refused.value.message
    # Asked all it may read, prepare stops before the room: the held-out prompts are the room's.
    prepared = run_job(compose(over(30, "run.stages=[prepare]"))).results["prepare"]
    manifest = json.loads((prepared.path / "manifest.json").read_text())
    assert manifest["sources"][0]["conversations_read"] == 30
    prompts = heldout_prompts(typed(compose(over(30))), 8, consumed(manifest, None))
    assert len(prompts) == 8
