"""Greedy generation in vLLM, optionally with an EAGLE-3 draft, in a process of its own.

Usage: `python -m stages.vllm_generate request.json result.json`
The request holds the target path, the draft path (or null), prompts, k, lengths and memory
settings; the result holds per-prompt token ids and texts, wall time, and vLLM's speculative-
decoding counters (drafts, draft tokens, accepted tokens, accepted per position).
vLLM starts worker processes and keeps global state, so `stages.evaluate` runs each
configuration as a separate child process, which also keeps vLLM out of the runner's process.
"""

from __future__ import annotations

import json
import sys
import time


def _counters(llm) -> dict:
    out: dict = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted",
    }
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in m.values]
            prev = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(vals, prev)] if prev else vals
    return out


def generate(req: dict) -> dict:
    from vllm import LLM, SamplingParams

    kwargs = dict(
        model=req["model"], dtype=req["dtype"], max_model_len=req["max_model_len"],
        tensor_parallel_size=req.get("tensor_parallel_size", 1), seed=0,
        disable_log_stats=False, trust_remote_code=req.get("trust_remote_code", False),
        gpu_memory_utilization=req["memory_utilization"],
    )
    if req.get("kv_cache_gib"):
        kwargs["kv_cache_memory_bytes"] = int(req["kv_cache_gib"] * (1 << 30))
    if req.get("enforce_eager"):
        kwargs["enforce_eager"] = True
    if req.get("draft"):
        kwargs["speculative_config"] = {
            "method": "eagle3", "model": req["draft"], "num_speculative_tokens": req["k"],
        }
    t0 = time.time()
    llm = LLM(**kwargs)
    init_s = time.time() - t0
    params = SamplingParams(temperature=0.0, max_tokens=req["max_new_tokens"])
    messages = [[{"role": "user", "content": p}] for p in req["prompts"]]
    t1 = time.time()
    outs = llm.chat(messages, params, use_tqdm=True)
    gen_s = time.time() - t1
    return {
        "init_s": init_s, "generate_s": gen_s,
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "texts": [o.outputs[0].text for o in outs],
        "prompt_tokens": [len(o.prompt_token_ids or []) for o in outs],
        "counters": _counters(llm) if req.get("draft") else None,
    }


if __name__ == "__main__":
    request_path, result_path = sys.argv[1], sys.argv[2]
    with open(request_path) as fh:
        request = json.load(fh)
    result = generate(request)
    with open(result_path + ".tmp", "w") as fh:
        json.dump(result, fh)
    import os

    os.replace(result_path + ".tmp", result_path)
