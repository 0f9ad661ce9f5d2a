"""An independent check of the evaluate stage's speed ratio on fresh servers: the same draft
served by the command its evaluation recorded, measured by other code.

What is shared with the stage: the servers' command lines (the draft's is the `serve_command` in
the evaluate artifact's manifest, the one a user pastes; the target's is the same without
`--speculative-config`) and the prompts. What is not: the server processes (two new ones, each
alone, the target first), the client, warm-up and timing (stages/evaluate/speed_check.py's: plain
HTTP from threads, three untimed passes, the server's `usage`; the stage measures through
aiohttp). `eval.speed_check` runs that client on the stage's own servers instead: this probe
adds what differs between one start of a server and another.

    python -m benchmarks.speed_probe <store>/evaluate/<key> [--repeats 5] [overrides]

Prints one `BENCH` JSON line per server and one with the ratios next to the stage's own.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from stages.evaluate import speed_check


def _line(name: str, values: dict) -> None:
    print(f"BENCH {name} {json.dumps(values)}", flush=True)


def _without_draft(words: list[str]) -> list[str]:
    i = words.index("--speculative-config")
    return words[:i] + words[i + 2 :]


def measure(
    words: list[str],
    env: dict[str, str],
    prompts: list[str],
    c1_prompts: int,
    max_tokens: int,
    repeats: int,
    log: Path,
    label: str,
    min_pass_s: float = 0.0,
) -> dict[str, Any]:
    """Start the server `words`, warm it, and measure both rates `repeats` times."""
    from runner.serving.vllm_server import VllmServer, free_port

    words = list(words)
    words[words.index("--port") + 1] = str(free_port())
    with VllmServer(words, {**os.environ, **env}, log, f"probe:{label}", 1800.0) as server:
        model = server.served_model()
        rates = speed_check.measure(
            {label: (server.base, model)},
            prompts,
            c1_prompts,
            max_tokens,
            repeats,
            warm_passes=3,
            min_pass_s=min_pass_s,
        )[label]
        start_s = server.start_s
        compiled = server.compile_cache()
    out = {k: statistics.median(v) for k, v in rates.items()}
    return {"median": out, "repeats": rates, "server_start_s": start_s, "compile_cache": compiled}


def probe(
    evaluate_dir: Path,
    prompts: list[str],
    c1_prompts: int,
    max_tokens: int,
    repeats: int,
    min_pass_s: float = 0.0,
) -> dict[str, Any]:
    """The ratio (draft-served over the target alone) at concurrency 1 and at batch, measured
    independently of the stage on the draft its artifact served."""
    manifest = json.loads((evaluate_dir / "manifest.json").read_text())
    words = shlex.split(manifest["served"]["serve_command"])
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    logs = Path(tempfile.mkdtemp(prefix="speed-probe-"))  # the servers' logs, kept
    got = {}
    for label, command in (("target", _without_draft(words)), ("draft", words)):
        log = logs / f"{label}.log"
        got[label] = measure(
            command, env, prompts, c1_prompts, max_tokens, repeats, log, label, min_pass_s
        )
        _line(f"probe_{label}", got[label])
    ratios = {k: got["draft"]["median"][k] / got["target"]["median"][k] for k in ("c1", "batch")}
    stage = manifest.get("metrics", {})
    _line(
        "probe_ratio",
        {
            "logs": str(logs),
            "probe": ratios,
            "stage": {k: stage.get(f"speedup_{k}") for k in ("c1", "batch")},
            "batch": len(prompts),
            "c1_prompts": c1_prompts,
            "repeats": repeats,
            "min_pass_s": min_pass_s,
        },
    )
    return {**ratios, "servers": got}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("evaluate_dir", type=Path)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_intermixed_args(argv)

    from runner.composition import compose_root

    compose_root()
    from runner.assets.sources import load_prompt_sets
    from runner.core.schema import typed
    from tests.conftest import compose

    cfg = typed(compose(a.overrides))
    prompts = next(iter(load_prompt_sets(cfg.eval.prompts, cfg.eval.num_prompts).values()))
    e = cfg.eval  # passes as long as the stage's (eval.speed_pass_s)
    probe(a.evaluate_dir, prompts, e.speed_prompts, e.max_new_tokens, a.repeats, e.speed_pass_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
