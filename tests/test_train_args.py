"""How `train` settings become speculators' own train settings, resolved by speculators' real
`TrainConfig.from_sources`, extra_args included, and its refusals named by the runner key."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.assets.target_facts import ModelFacts
from runner.core.schema import typed
from runner.integrations.speculators_config import Refused, command_line, resolve_train_config
from runner.integrations.speculators_settings import setting_key, speculators_settings
from tests.conftest import compose

FACTS = ModelFacts(
    path="/models/target",
    num_layers=30,
    hidden_size=576,
    vocab_size=49152,
    aux_layers=(2, 15, 27),
    extract_aux=(2, 15, 27),
    tokenizer_id="t",
    weights_id="w",
)


def settings_for(*overrides: str, facts: ModelFacts = FACTS, online: str | None = None):
    cfg = typed(compose(list(overrides)))
    p = Path("/runs")
    return cfg, speculators_settings(
        cfg, facts, p / "data", p / "hs", p / "vocab", p / "save", online=online
    )


def test_speculators_reads_the_runners_settings():
    _, settings = settings_for(
        "train.lr=2e-4",
        "train.epochs=3",
        "vocab.draft_vocab_size=4096",
        "+train.extra_args.norm_output=false",
        "+train.extra_args.norm_before_fc=true",
    )
    cfg = resolve_train_config(settings, slots=(0, 1, 2, 3))
    assert cfg.draft.target_layer_ids == [2, 15, 27]  # vLLM convention, final layer implied
    assert cfg.draft.norm_before_fc is True and cfg.draft.norm_output is False
    assert settings["lr"] == 2e-4 and settings["epochs"] == 3
    assert settings["draft_vocab_size"] == 4096
    assert settings["total_seq_len"] == 256  # null = data.max_seq_len
    assert "hidden_states_backend" not in settings  # every extracted slot is this job's
    # The recorded command is the one `speculators train` would take.
    argv = command_line(settings)
    assert argv[argv.index("--lr") + 1] == "0.0002" and "--no-norm-output" in argv


def test_a_sweeps_superset_is_read_through_the_slot_backend():
    shared = ModelFacts(**{**FACTS.__dict__, "extract_aux": (1, 2, 7, 15, 27)})
    _, settings = settings_for(facts=shared)
    assert settings["hidden_states_backend"] == "runner-slots"
    assert shared.train_slots == (1, 3, 4, 5)


@pytest.mark.parametrize(
    ("override", "key", "says"),
    [
        ("+train.extra_args.no_such_flag=1", "train.extra_args.no_such_flag", "no setting"),
        ("+train.extra_args.weight_decay=abc", "train.extra_args.weight_decay", "number"),
        ("+train.extra_args.checkpoint_freq=-1", "train.extra_args.checkpoint_freq", "> 0"),
        ("train.checkpoint_every=0.5", None, None),
    ],
)
def test_a_setting_speculators_refuses_names_its_runner_key(override, key, says):
    cfg, settings = settings_for(override)
    if key is None:
        assert resolve_train_config(settings, slots=(0, 1, 2, 3)) is not None
        return
    with pytest.raises(Refused) as info:
        resolve_train_config(settings, slots=(0, 1, 2, 3))
    assert setting_key(cfg, info.value.dest) == key and says in info.value.message


def test_a_runner_setting_speculators_refuses_names_the_runner_key():
    cfg, settings = settings_for()
    settings["scheduler_warmup_ratio"] = "soon"  # what a wrong value of train.warmup_ratio gives
    with pytest.raises(Refused) as info:
        resolve_train_config(settings)
    assert setting_key(cfg, info.value.dest) == "train.warmup_ratio"


def test_online_training_fetches_from_the_server_and_reads_no_files():
    _, settings = settings_for(
        "extract=online",
        "extract.max_retries=5",
        "extract.storage=fp8",
        online="http://127.0.0.1:8123/v1",
    )
    resolved = resolve_train_config(settings, slots=(0, 1, 2, 3))
    assert settings["on_missing"] == "generate"
    assert settings["vllm_endpoint"] == "http://127.0.0.1:8123/v1"
    assert settings["max_retries"] == 5 and settings["request_timeout"] == 600
    # The server writes the target's dtype whatever extract.storage says: no fp8 reader.
    assert "hidden_states_backend" not in settings
    assert resolved is not None


def test_training_rate_is_the_steady_state_median_not_the_compiling_first_step():
    """Online and offline training compare by tokens/s after the first step (which compiles for
    minutes on a GPU), read from speculators' own per-step profile."""
    from runner.integrations.speculators_metrics import summarise

    records = [
        {"step": 0, "train/loss": 9.0, "profile/tokens_per_s": 50.0, "profile/fetch_frac": 0.9},
        *(
            {
                "step": i,
                "train/loss": 5.0,
                "profile/tokens_per_s": 1000.0 + i,
                "profile/fetch_frac": 0.1,
            }
            for i in range(1, 6)
        ),
        {"step": 6, "val/loss": 4.0},
    ]
    out = summarise(records)
    assert out["tokens_per_s_median"] == 1003.0 and out["fetch_frac_median"] == 0.1
    assert out["steps"] == 6 and out["val_loss"] == 4.0 and out["first_loss"] == 9.0
    assert "tokens_per_s_median" not in summarise(records[:1])


def test_the_training_progress_line_carries_loss_accuracy_and_the_whole_stages_eta(
    caplog, monkeypatch
):
    """Epoch 1 of 3, 10 steps each, but train.max_steps=25: the line counts to 25 (not to the
    epoch's 10 or the epochs' 30), with the newest loss and the first positions' accuracy."""
    import logging
    import time
    from types import SimpleNamespace

    import runner.integrations.speculators as sp

    monkeypatch.setattr(sp, "PROGRESS_EVERY_S", 0.0)
    clock = iter([100.0, 100.0, 101.0, 102.0, 103.0])
    fake = SimpleNamespace(time=lambda: next(clock), strftime=time.strftime, gmtime=time.gmtime)
    monkeypatch.setattr(sp, "time", fake)
    records = [{"step": 4, "train/loss": 9.5, "train/full_acc_0": 0.25, "train/full_acc_1": 0.1}]
    progress = sp._Progress(epoch=0, epochs=3, steps=10, total=25, records=records)
    with caplog.at_level(logging.INFO, logger="runner"):
        progress.step(5)  # the first step: the rate starts here
        progress.step(6)
        records.append({"step": 6, "train/loss": 8.25, "train/full_acc_0": 0.5})
        progress.step(7)
        # Several steps since the last line: their mean, not the newest step's jumpy value.
        records.append({"step": 7, "train/loss": 6.0, "train/full_acc_0": 0.5})
        records.append({"step": 8, "train/loss": 8.0, "train/full_acc_0": 0.7})
        progress.step(8)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[2].startswith("[train] step 8/25 (epoch 1/3), loss 7.000, acc 0.60 (mean of 2 ")
    assert lines[0] == (
        "[train] step 6/25 (epoch 1/3), loss 9.500, acc 0.25/0.10, 1.00 steps/s, "
        "stage ends in 00:19"
    )
    assert lines[1].startswith("[train] step 7/25 (epoch 1/3), loss 8.250, acc 0.50, ")
    assert lines[1].endswith("stage ends in 00:18")
