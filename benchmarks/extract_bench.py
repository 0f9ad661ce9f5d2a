"""Extraction speed, measured in one run on one device: the runner's extractor against a bare
forward pass of the same model and batches, and against a naive extractor (hooks, synchronous
copy to the host, one safetensors file per sample written synchronously), with the disk's write
bandwidth as the other possible bound.

Usage (random-init Llama shapes; needs only torch, transformers, safetensors, tqdm):
    python -m benchmarks.extract_bench --shape smollm2 --device cpu --batch 4 --seq 512 --batches 4
    python -m benchmarks.extract_bench --shape llama8b --device cuda --batch 8 --seq 2048 \
        --batches 6 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "smollm2": (576, 1536, 30, 9, 3, 49152),
    "llama1b": (2048, 8192, 16, 32, 8, 128256),
    "llama8b": (4096, 14336, 32, 32, 8, 128256),
}


def build_model(shape: str, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    h, inter, layers, heads, kv, vocab = SHAPES[shape]
    cfg = LlamaConfig(
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    return model.eval(), layers


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def disk_write_bandwidth(folder: Path, total: int = 1 << 30) -> float:
    """Bytes per second for a buffered write of `total` bytes plus fsync, in 64 MiB chunks."""
    chunk = os.urandom(1 << 20) * 64
    path = folder / "bw.bin"
    t0 = time.time()
    with open(path, "wb") as fh:
        for _ in range(total // len(chunk)):
            fh.write(chunk)
        fh.flush()
        os.fsync(fh.fileno())
    dt = time.time() - t0
    path.unlink()
    return total / dt


def main(argv: list[str] | None = None) -> dict:
    import torch
    from safetensors.torch import save_file

    from stages.extract.samples import LayerStats
    from stages.extract.transformers_backend import TransformersBackend, extract_to_files

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where files are written (default: a temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    model, n = build_model(args.shape, args.device)
    ids = (2, n // 2, n - 3, n)  # speculators' default aux layers + the final pre-norm layer
    backend = TransformersBackend(model, ids, n, args.batch)
    g = torch.Generator().manual_seed(0)
    vocab = SHAPES[args.shape][5]
    rows = [
        torch.randint(0, vocab, (args.seq,), generator=g)
        for _ in range(args.batch * (args.batches + 1))
    ]
    warm, timed = rows[: args.batch], rows[args.batch :]
    tokens = sum(len(r) for r in timed)
    work = Path(args.dir or tempfile.mkdtemp(prefix="extract_bench_"))
    work.mkdir(parents=True, exist_ok=True)

    def batches(rs):
        return [rs[i : i + args.batch] for i in range(0, len(rs), args.batch)]

    # 1. bare forward: no hooks, nothing leaves the device
    for h in backend._hooks:
        h.remove()
    with torch.inference_mode():
        for phase in (warm, timed):
            sync(args.device)
            t0 = time.time()
            for b in batches(phase):
                x = torch.stack(b).to(args.device)
                model(
                    input_ids=x,
                    attention_mask=torch.ones_like(x),
                    use_cache=False,
                    logits_to_keep=1,
                )
            sync(args.device)
            bare_s = time.time() - t0
    backend = TransformersBackend(model, ids, n, args.batch)

    # 2. naive: hooks, synchronous copy to the host, one file per sample written synchronously
    naive_dir = work / "naive"
    for phase in (warm, timed):
        shutil.rmtree(naive_dir, ignore_errors=True)
        naive_dir.mkdir()
        sync(args.device)
        t0 = time.time()
        k = 0
        for b in batches(phase):
            host = backend.forward(b).cpu()
            for r, row in enumerate(b):
                save_file(
                    {"hidden_states": host[r, : len(row)].clone(), "token_ids": row},
                    str(naive_dir / f"hs_{k}.safetensors"),
                )
                k += 1
        naive_s = time.time() - t0
    shutil.rmtree(naive_dir, ignore_errors=True)

    # 3. the runner's extractor (overlapped copies, background writers, on-device statistics)
    runner_dir = work / "runner"
    for phase in (warm, timed):
        shutil.rmtree(runner_dir, ignore_errors=True)
        runner_dir.mkdir()
        sync(args.device)
        result = extract_to_files(backend, phase, runner_dir, LayerStats(ids), progress=False)
    runner_s = result["seconds"]
    written = sum(p.stat().st_size for p in runner_dir.iterdir())
    shutil.rmtree(runner_dir, ignore_errors=True)
    backend.close()

    bw = disk_write_bandwidth(work)
    hidden = SHAPES[args.shape][0]
    bytes_per_token = written / tokens
    minimum = len(ids) * hidden * 2
    bare_tps = tokens / bare_s
    disk_tps = bw / bytes_per_token
    bound = "disk write" if disk_tps < bare_tps else "forward pass"
    bound_s = max(bare_s, tokens / disk_tps)
    out = {
        "shape": args.shape,
        "device": args.device,
        "batch": args.batch,
        "seq": args.seq,
        "tokens": tokens,
        "slots": len(ids),
        "bare_forward_tok_s": bare_tps,
        "runner_tok_s": tokens / runner_s,
        "naive_tok_s": tokens / naive_s,
        "runner_time_over_forward": runner_s / bare_s,
        "naive_time_over_forward": naive_s / bare_s,
        "runner_time_over_bound": runner_s / bound_s,
        "naive_over_runner_time": naive_s / runner_s,
        "disk_write_GBps": bw / 1e9,
        "disk_bound_tok_s": disk_tps,
        "bound": bound,
        "bytes_per_token_per_layer": bytes_per_token / len(ids),
        "bytes_per_token_per_layer_minimum": hidden * 2,
        "bytes_over_minimum": bytes_per_token / minimum,
    }
    print(
        f"{args.shape} on {args.device}: {tokens} tokens, {len(ids)} slots, "
        f"batch {args.batch}x{args.seq}"
    )
    print(f"  bare forward      {bare_tps:12,.0f} tok/s")
    print(
        f"  runner extractor  {tokens / runner_s:12,.0f} tok/s  = "
        f"{runner_s / bare_s:.2f}x forward time, "
        f"{runner_s / bound_s:.2f}x the {bound} bound"
    )
    print(
        f"  naive extractor   {tokens / naive_s:12,.0f} tok/s  = "
        f"{naive_s / bare_s:.2f}x forward time "
        f"({naive_s / runner_s:.2f}x the runner's)"
    )
    print(
        f"  disk write        {bw / 1e9:8.2f} GB/s -> bound {disk_tps:,.0f} tok/s; "
        f"bound that applies: {bound}"
    )
    print(
        f"  bytes/token/layer {bytes_per_token / len(ids):8.1f} "
        f"(minimum {hidden * 2}: {bytes_per_token / minimum:.3f}x)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return out


if __name__ == "__main__":
    main()
