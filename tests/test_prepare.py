"""prepare: chat template rendering, assistant-only loss masks, truncation, data sources."""

from __future__ import annotations

import json

import pytest

from runner.assets.conversations import (
    iter_truncated_json_array,
    load_conversations,
    normalise_turns,
)
from stages.prepare import tokenize_conversation
from tests.conftest import CONVERSATIONS, compose


def _spans(ids, mask):
    spans, cur = [], []
    for t, m in zip(ids, mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    return spans


def test_mask_covers_exactly_every_assistant_turn(smollm2_tokenizer):
    tok = smollm2_tokenizer
    turns = CONVERSATIONS[0]  # two user and two assistant turns
    ids, mask = tokenize_conversation(tok, turns, max_len=4096)
    assert ids == tok.apply_chat_template(turns, tokenize=True, return_dict=False)
    spans = [tok.decode(s) for s in _spans(ids, mask)]
    # One supervised span per assistant turn: its text and the end-of-turn token that stops it.
    assert spans == [f"{t['content']}<|im_end|>\n" for t in turns if t["role"] == "assistant"]
    # Nothing of the user turns, the system prompt or the role headers is supervised.
    masked_text = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert "What is the capital of France?" in masked_text and "Paris" not in masked_text


def test_truncation_cuts_ids_and_mask_together(smollm2_tokenizer):
    ids, mask = tokenize_conversation(smollm2_tokenizer, CONVERSATIONS[0], max_len=40)
    assert len(ids) == len(mask) == 40
    full_ids, full_mask = tokenize_conversation(smollm2_tokenizer, CONVERSATIONS[0], max_len=4096)
    assert ids == full_ids[:40] and mask == full_mask[:40]


def test_opening_assistant_turn_is_context(smollm2_tokenizer):
    turns = [
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "Hi!"},
    ]
    ids, mask = tokenize_conversation(smollm2_tokenizer, turns, max_len=4096)
    assert [smollm2_tokenizer.decode(s) for s in _spans(ids, mask)] == ["Hi!<|im_end|>\n"]


def test_truncated_json_array_recovers_complete_records():
    records = [{"id": i, "conversations": [{"from": "human", "value": "q" * i}]} for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = text[: text.index('"id": 4') + 3]  # cut inside the last record
    assert [r["id"] for r in iter_truncated_json_array(cut)] == [0, 1, 2, 3]
    assert [r["id"] for r in iter_truncated_json_array(text)] == [0, 1, 2, 3, 4]


def test_turn_formats_are_normalised():
    sharegpt = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    openai = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert normalise_turns(sharegpt) == normalise_turns(openai) == openai
    assert normalise_turns([{"from": "human", "value": "only a question"}]) is None


def test_local_jsonl_and_parquet_sources(chats_jsonl, tmp_path):
    import datasets

    cfg = compose(["data=local_file", f"data.source={chats_jsonl}", "data.shuffle=false"]).data
    convs = load_conversations(cfg)
    assert len(convs) == 60 and convs[0][1]["content"].startswith("The capital of France is Paris.")
    parquet = tmp_path / "chats.parquet"
    datasets.load_dataset("json", data_files=str(chats_jsonl), split="train").to_parquet(
        str(parquet)
    )
    cfg = compose(["data=local_file", f"data.source={parquet}", "data.shuffle=false"]).data
    assert load_conversations(cfg) == convs


def test_packaged_sharegpt_is_recovered():
    cfg = compose(["data.shuffle=false"]).data
    convs = load_conversations(cfg)
    # The packaged file is cut short; complete records are recovered (about 17.6k usable).
    assert len(convs) > 15000
    assert all(any(t["role"] == "assistant" for t in c) for c in convs[:100])


def test_missing_file_and_wrong_column_name_the_key(tmp_path, chats_jsonl):
    from runner.core.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        load_conversations(compose(["data=local_file", f"data.source={tmp_path}/nope.jsonl"]).data)
    assert info.value.key == "data.source"
    with pytest.raises(ConfigError) as info:
        load_conversations(
            compose(["data=local_file", f"data.source={chats_jsonl}", "data.column=dialog"]).data
        )
    assert info.value.key == "data.column"
