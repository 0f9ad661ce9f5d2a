"""The regenerate stage on a tiny target (transformers backend): the target's own answers replace
the data's, prepare trains on them, a stopped run resumes, and too many bad generations fail the
stage naming the setting. The vLLM backend and its parity with this one: tests/test_vllm_backend.py.
"""

from __future__ import annotations

import json

import pytest

from runner.core.errors import StageError
from runner.core.interrupts import Interrupted
from tests.conftest import compose, run_job, tiny_overrides

# Sampled: the random tiny target's greedy answer is one whitespace token repeated, which the
# stage counts as failed (an empty answer).
REGEN = [
    "regenerate=transformers",
    "regenerate.batch_size=4",
    "regenerate.temperature=1.0",
    "model.capture_layers=[1,2,3]",
]


def _over(model_dir, chats, root, *extra, samples=6):
    return tiny_overrides(
        model_dir, chats, root, *REGEN, "run.stages=[regenerate,prepare]", *extra, samples=samples
    )


def test_the_targets_own_answers_replace_the_datas(tiny_model_dir, chats_jsonl, tmp_path):
    import datasets
    from transformers import AutoTokenizer

    result = run_job(compose(_over(tiny_model_dir, chats_jsonl, tmp_path)))
    assert result.stages == {"regenerate": "computed", "prepare": "computed"}
    regen = result.results["regenerate"]
    m = regen.metrics
    assert m["conversations"] == 6 and m["failed"] == 0 and m["generated_tokens"] > 0
    written = (regen.path / "regenerated" / "source_0.jsonl").read_text()
    records = [json.loads(x) for x in written.splitlines()]
    original = [json.loads(x)["messages"] for x in chats_jsonl.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    for rec in records:
        turns = rec["conversations"]
        answers = [t["content"] for t in turns if t["role"] == "assistant"]
        assert len(answers) == len(rec["token_ids"]) == len(rec["finish_reasons"]) >= 1
        # Every answer is exactly the decoded ids the target generated; the user turns are the
        # data's own, in their order.
        assert answers == [tok.decode(ids, skip_special_tokens=True) for ids in rec["token_ids"]]
        users = [t["content"] for t in turns if t["role"] == "user"]
        assert any(
            users == [t["content"] for t in o if t["role"] == "user"][: len(users)]
            for o in original
        )
        assert not any(a in {t["content"] for o in original for t in o} for a in answers)
    # prepare trains on them: its rows are the regenerated conversations rendered.
    rows = datasets.load_from_disk(str(result.results["prepare"].path / "dataset"))
    assert len(rows) == 6
    assert all(len(r["input_ids"]) <= 96 for r in rows)
    # The same settings reuse both; the original data's run is another prepare artifact.
    again = run_job(compose(_over(tiny_model_dir, chats_jsonl, tmp_path)))
    assert again.stages == {"regenerate": "cached", "prepare": "cached"}
    plain = run_job(
        compose(
            _over(tiny_model_dir, chats_jsonl, tmp_path, "regenerate=none", "run.stages=[prepare]")
        )
    )
    assert plain.stages == {"prepare": "computed"}
    assert plain.results["prepare"].key != result.results["prepare"].key


def test_a_stopped_regeneration_resumes_and_bad_answers_fail_it(
    tiny_model_dir, chats_jsonl, tmp_path, monkeypatch
):
    from stages import regenerate

    # Stop after the first chunk of two conversations, as a crash would.
    monkeypatch.setattr(regenerate, "chunk_size", lambda r: 2)
    calls = {"n": 0}
    real = regenerate._run_chunk

    def crash_after_first(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(regenerate, "_run_chunk", crash_after_first)
    over = _over(tiny_model_dir, chats_jsonl, tmp_path)
    with pytest.raises(Interrupted):  # what the runner makes of Ctrl-C
        run_job(compose(over))
    chunks = []

    def counted(jobs, *args, **kwargs):
        chunks.append([j.index for j in jobs])
        return real(jobs, *args, **kwargs)

    monkeypatch.setattr(regenerate, "_run_chunk", counted)
    resumed = run_job(compose(over)).results["regenerate"]
    # The first two conversations came from the stopped attempt; the rest were generated now,
    # and the counts add both attempts up.
    assert chunks == [[2, 3], [4, 5]]
    assert resumed.metrics["conversations"] == 6
    assert resumed.metrics["generations"] >= 6
    # Answers cut at max_tokens are truncated: above the allowed share, the stage fails.
    with pytest.raises(StageError, match=r"regenerate\.max_bad_fraction"):
        run_job(compose([*over, "regenerate.max_tokens=2", "regenerate.max_bad_fraction=0.5"]))


def test_continuous_batching_gives_the_padded_calls_greedy_answers(
    smollm2_tokenizer, chats_jsonl, tmp_path
):
    """regenerate.continuous_batching (the GPU setting: transformers' paged batcher) writes the
    same greedy answers as padded generate calls, turn by turn, each cut at its own limit."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # Wide random weights: greedy answers that vary from token to token and prompt to prompt
    # (the default tiny target repeats one whitespace token).
    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.4,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model_dir = tmp_path / "wide"
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    smollm2_tokenizer.save_pretrained(model_dir)
    answers = {}
    for cb in ("false", "true"):
        over = _over(
            model_dir,
            chats_jsonl,
            tmp_path,
            "regenerate.temperature=0",
            "run.stages=[regenerate]",
            "regenerate.max_tokens=24",
            "regenerate.max_bad_fraction=1",
            f"regenerate.continuous_batching={cb}",
            "hardware.dtype=float32",
        )
        regen = run_job(compose(over)).results["regenerate"]
        lines = (regen.path / "regenerated" / "source_0.jsonl").read_text().splitlines()
        answers[cb] = [
            (r["index"], r["token_ids"], r["finish_reasons"]) for r in map(json.loads, lines)
        ]
    assert answers["true"] == answers["false"]
    tokens = [t for _, ids, _ in answers["true"] for turn in ids for t in turn]
    assert len(tokens) > 24 and len(set(tokens)) > 5  # real answers, not one token repeated
