"""How `train` settings become speculators' own arguments, checked against speculators' real
argument parser (TrainConfig.resolve), extra_args included."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.errors import ConfigError
from runner.integrations.speculators import resolve_train_config as resolve_argv
from runner.schema import typed
from runner.target_facts import ModelFacts
from stages.train import extra_flags, speculators_argv
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


def argv_for(*overrides: str, facts: ModelFacts = FACTS) -> list[str]:
    cfg = typed(compose(list(overrides)))
    p = Path("/runs")
    return speculators_argv(cfg, facts, p / "data", p / "hs", p / "vocab", p / "save")


def test_extra_args_map_to_flags():
    flags = extra_flags(
        {
            "norm_before_fc": True,
            "norm_output": False,
            "dry_run": False,
            "target_layer_ids": [1, 2],
            "checkpoint_freq": 0.5,
        }
    )
    assert flags == [
        "--norm-before-fc",
        "--no-norm-output",
        "--target-layer-ids",
        "1",
        "2",
        "--checkpoint-freq",
        "0.5",
    ]  # (--dry-run has no --no- form)


def test_speculators_reads_the_runners_settings():
    argv = argv_for(
        "train.lr=2e-4",
        "train.epochs=3",
        "train.draft_vocab_size=4096",
        "+train.extra_args.norm_output=false",
        "+train.extra_args.norm_before_fc=true",
    )
    cfg = resolve_argv(argv, slots=(0, 1, 2, 3))
    assert cfg.draft.target_layer_ids == [2, 15, 27]  # vLLM convention, final layer implied
    assert cfg.draft.norm_before_fc is True and cfg.draft.norm_output is False
    assert argv[argv.index("--lr") + 1] == "0.0002" and argv[argv.index("--epochs") + 1] == "3"
    assert argv[argv.index("--draft-vocab-size") + 1] == "4096"
    assert argv[argv.index("--total-seq-len") + 1] == "512"  # null = data.max_seq_len
    assert "--hidden-states-backend" not in argv  # every extracted slot is this job's


def test_a_sweeps_superset_is_read_through_the_slot_backend():
    shared = ModelFacts(**{**FACTS.__dict__, "extract_aux": (1, 2, 7, 15, 27)})
    argv = argv_for(facts=shared)
    assert argv[argv.index("--hidden-states-backend") + 1] == "runner-slots"
    assert shared.train_slots == (1, 3, 4, 5)


def test_a_flag_speculators_does_not_know_names_extra_args():
    argv = argv_for("+train.extra_args.no_such_flag=1")
    with pytest.raises(ConfigError) as info:
        resolve_argv(argv, slots=(0, 1, 2, 3))
    assert info.value.key == "train.extra_args" and "--no-such-flag" in info.value.message


def test_online_training_fetches_from_the_server_and_reads_no_files():
    cfg = typed(compose(["extract=online", "extract.max_retries=5", "extract.storage=fp8"]))
    p = Path("/runs")
    argv = speculators_argv(
        cfg,
        FACTS,
        p / "data",
        p / "empty",
        p / "vocab",
        p / "save",
        online="http://127.0.0.1:8123/v1",
    )
    resolved = resolve_argv(argv, slots=(0, 1, 2, 3))
    flags = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    assert flags["--on-missing"] == "generate"
    assert flags["--vllm-endpoint"] == "http://127.0.0.1:8123/v1"
    assert flags["--max-retries"] == "5" and flags["--request-timeout"] == "600"
    # The server writes the target's dtype whatever extract.storage says: no fp8 reader.
    assert "--hidden-states-backend" not in argv
    assert resolved is not None
