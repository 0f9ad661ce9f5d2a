"""Draft training at a given shape through the runner's own train stage, on synthetic hidden
states: tokens/s on N GPUs, peak memory against the plan's estimate, and speculators called
directly with the same arguments.

    python -m benchmarks.train_scaling setup --root /tmp/bench --shape kimi
    python -m benchmarks.train_scaling train --root /tmp/bench --gpus 1 --steps 30 [--fsdp]
    python -m benchmarks.train_scaling direct --root /tmp/bench --steps 30

`setup` writes a target folder with the shape's config.json and the only weights speculators
loads from it (token embedding, final norm, LM head; random), and puts prepare, extract and vocab
artifacts into the runner's store under the very keys the runner computes for that config:
rows of `--row-len` tokens whose hidden-state files are links to a few real random files (the
trainer reads files; their content does not change the speed). `train` then runs
`python -m runner ... run.stages=[train] run.force=[train]` and prints tokens/s (speculators'
own step profile, first 5 steps skipped), the peak memory per GPU, and the plan's estimate.
`direct` runs speculators' trainer on the argv the last `train` recorded, in a fresh process.

Shapes: kimi (hidden 7168, vocab 163,840 -> 32,000, intermediate 18,432, 64 heads, 61 layers)
and smollm2 (576, 49,152 -> 8,192, 1,536, 9/3 heads, 30 layers); `tiny` for a CPU check.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHAPES = {
    "kimi": dict(
        hidden=7168,
        vocab=163840,
        draft_vocab=32000,
        inter=18432,
        heads=64,
        kv=64,
        layers=61,
        aux=[2, 30, 58],
        seq=8192,
    ),
    "smollm2": dict(
        hidden=576,
        vocab=49152,
        draft_vocab=8192,
        inter=1536,
        heads=9,
        kv=3,
        layers=30,
        aux=[2, 15, 27],
        seq=8192,
    ),
    "tiny": dict(
        hidden=64,
        vocab=4096,
        draft_vocab=512,
        inter=128,
        heads=4,
        kv=2,
        layers=4,
        aux=[0, 2, 3],
        seq=512,
    ),
}


def overrides(root: Path, shape: str, extra: list[str]) -> list[str]:
    s = SHAPES[shape]
    on_gpu = shape != "tiny"
    return [
        "model=hf",
        f"model.source={root / 'target'}",
        f"model.name={shape}-shape",
        f"model.capture_layers=[{','.join(map(str, s['aux']))}]",
        "data=local_file",
        f"data.source={root / 'rows.jsonl'}",
        f"data.max_seq_len={min(2048, s['seq'])}",
        *(["hardware=gpu1", "train=eagle3_gpu"] if on_gpu else ["train.num_workers=0"]),
        f"vocab.draft_vocab_size={s['draft_vocab']}",
        f"train.total_seq_len={s['seq']}",
        "train.epochs=1",
        "train.log_freq=1",
        f"run.output_root={root / 'out'}",
        *extra,
    ]


def setup(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    from runner.assets.target_facts import resolve_target
    from runner.core.schema import typed
    from runner.core.store import ArtifactStore
    from runner.engine.pipeline import Pipeline
    from stages import REGISTRY
    from stages.extract.samples import write_sample
    from tests.conftest import compose

    s, root = SHAPES[args.shape], Path(args.root)
    target = root / "target"
    target.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv"],
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(target)
    # speculators reads the target's tokenizer for its special tokens only: a four-token one.
    words = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    fast.save_pretrained(target)
    g = torch.Generator().manual_seed(0)
    weights = {
        "model.embed_tokens.weight": torch.randn(s["vocab"], s["hidden"], generator=g) * 0.02,
        "lm_head.weight": torch.randn(s["vocab"], s["hidden"], generator=g) * 0.02,
        "model.norm.weight": torch.ones(s["hidden"]),
    }
    weights = {k: v.to(torch.bfloat16) for k, v in weights.items()}
    save_file(weights, str(target / "model.safetensors"))
    (root / "rows.jsonl").write_text('{"messages": []}\n')  # the data source named in the config
    cfg = typed(compose(overrides(root, args.shape, list(args.overrides))))
    facts = resolve_target(cfg, Path(cfg.run.output_root)).facts
    store = ArtifactStore(Path(cfg.run.output_root))
    planned = {p.name: p for p in Pipeline(cfg, facts, store, REGISTRY).plan()}
    n, rows, files = args.row_len, args.rows, args.files
    slots = len(facts.extract_ids)

    def publish(stage: str, fill) -> Path:
        p = planned[stage]
        if store.get(stage, p.key) is None:
            manifest = {
                "config": p.stage.key_config(cfg, facts),
                "model": facts.as_dict(),
                "metrics": {},
                "synthetic": True,
            }
            with store.writing(stage, p.key, manifest) as tmp:
                fill(tmp, manifest)
        return store.path(stage, p.key)

    def prepare(tmp: Path, manifest: dict) -> None:
        import datasets

        # Rows repeat every `files`, as the hidden-state files below do.
        distinct = torch.randint(3, s["vocab"], (files, n), generator=g).tolist()
        ids = [distinct[i % files] for i in range(rows)]
        ds = datasets.Dataset.from_dict(
            {"input_ids": ids, "loss_mask": [[1] * n] * rows, "seq_len": [n] * rows}
        )
        ds.set_format("torch")
        ds.save_to_disk(str(tmp / "dataset"))
        manifest["metrics"] = {"rows": rows, "tokens": rows * n}

    def extract(tmp: Path, manifest: dict) -> None:
        prepared = publish("prepare", prepare)
        import datasets

        ds = datasets.load_from_disk(str(prepared / "dataset")).with_format("torch")
        out = tmp / "hidden_states"
        out.mkdir()
        for i in range(rows):
            if i < files:  # in the configured storage (extract.storage), as extract writes
                hs = (torch.randn(n, slots, s["hidden"], generator=g) * 0.5).to(torch.bfloat16)
                write_sample(
                    out / f"hs_{i}.safetensors", hs, ds[i]["input_ids"], cfg.extract.storage
                )
            else:  # the same states again: token ids must match, so rows repeat too
                os.link(out / f"hs_{i % files}.safetensors", out / f"hs_{i}.safetensors")
        (tmp / "capture_ids.json").write_text(json.dumps(list(facts.extract_ids)))
        manifest["metrics"] = {"tokens": rows * n, "samples": rows}

    def vocab(tmp: Path, manifest: dict) -> None:
        import numpy as np

        keep = np.sort(np.random.default_rng(0).choice(s["vocab"], s["draft_vocab"], replace=False))
        np.save(tmp / "d2t.npy", keep - np.arange(s["draft_vocab"]))
        t2d = np.zeros(s["vocab"], dtype=bool)
        t2d[keep] = True
        np.save(tmp / "t2d.npy", t2d)

    publish("prepare", prepare)
    publish("extract", extract)
    publish("vocab", vocab)
    print(
        f"synthetic {args.shape} store in {root / 'out'}: {rows} rows x {n} tokens, "
        f"{files} distinct hidden-state files"
    )


def tokens_per_s(records: list[dict], skip: int = 5) -> float:
    steps = [r for r in records if "profile/step_ms" in r][skip:]
    tokens = sum(r["profile/tokens_per_s"] * r["profile/step_ms"] / 1000 for r in steps)
    return tokens / (sum(r["profile/step_ms"] for r in steps) / 1000)


def train(args: argparse.Namespace) -> None:
    root = Path(args.root)
    extra = [
        "run.stages=[train]",
        "run.force=[train]",
        f"train.max_steps={args.steps}",
        *args.overrides,
    ]
    if args.shape != "tiny":
        extra += [f"hardware.num_gpus={max(args.gpus, 1)}", f"train.num_gpus={args.gpus}"]
    if args.fsdp:
        extra.append("train.fsdp=true")
    cmd = [sys.executable, "-m", "runner", *overrides(root, args.shape, extra)]
    t0 = time.time()
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stdout[-4000:] + out.stderr[-4000:])
    plan = [line for line in out.stdout.splitlines() if "training memory" in line]
    # The summary's stage line ("  train     computed   12.3 s  <path>"), not the plan's.
    line = next(
        x for x in out.stdout.splitlines() if re.match(r"\s+train\s+(computed|cached)\s", x)
    )
    art = Path(line.split()[-1])
    m = json.loads((art / "manifest.json").read_text())
    records = [json.loads(x) for x in (art / "metrics.jsonl").read_text().splitlines()]
    result = {
        "gpus": args.gpus,
        "fsdp": args.fsdp,
        "shape": args.shape,
        # speculators' step profile counts the tokens of rank 0's batch; every rank takes as
        # many (packed batches of total_seq_len), so the total is ranks times that.
        "tokens_per_s": tokens_per_s(records) * max(args.gpus, 1),
        "tokens_per_s_per_gpu": tokens_per_s(records),
        "wall_s": time.time() - t0,
        "stage_s": m["seconds"],
        **{
            k: v
            for k, v in m["metrics"].items()
            if k.startswith("peak_") or k in ("steps", "ranks", "resumes", "steps_redone")
        },
        "plan_memory": plan[0].strip() if plan else "",
    }
    (root / "last_argv.json").write_text(json.dumps(m["speculators_command"]))
    print(json.dumps(result))


def direct(args: argparse.Namespace) -> None:
    """speculators' own trainer, plain (with the one fix torch 2.11 needs), same argv."""
    root = Path(args.root)
    argv = [
        a
        for a in json.loads((root / "last_argv.json").read_text())
        if a not in ("--logger", "mlflow")
    ]
    argv[argv.index("--save-path") + 1] = tempfile.mkdtemp(prefix="direct_", dir=root)
    t0 = time.time()
    from benchmarks.train_bench import direct as run_direct

    records = run_direct(argv)
    print(json.dumps({"direct_tokens_per_s": tokens_per_s(records), "wall_s": time.time() - t0}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["setup", "train", "direct"])
    ap.add_argument("--root", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="kimi")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--row-len", type=int, default=2048)
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--fsdp", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args()
    {"setup": setup, "train": train, "direct": direct}[args.command](args)


if __name__ == "__main__":
    main()
