"""vLLM extraction against in-process extraction on the same rows, measured in one run: where the
vLLM path's time goes as the client keeps more requests in flight.

One extraction server is started with the extract stage's own flags (`stages.extract.vllm_backend.
server_args`, so extract.batch_tokens applies); speculators' data-generation client then sends
the same prepared rows at each concurrency in turn, each pass into a fresh folder, and the
in-process (transformers) backend extracts the same rows once. Every figure is printed as one
`BENCH` JSON line: rows/s, tokens/s, the client's own mean request and move times, and the ratio
to in-process.

Usage (runner overrides after `--`; the prepared rows come from the runner's store, computed if
missing):
    python -m benchmarks.vllm_extract_bench --concurrency 32 64 128 256 -- hardware=gpu1 \
        data.num_samples=1500
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path


def _line(name: str, values: dict) -> None:
    print(f"BENCH {name} {json.dumps(values)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)

    import datasets

    import runner.__main__  # noqa: F401  (registers the schema)
    from runner.job import run_job
    from runner.schema import typed
    from runner.vllm_server import serve
    from stages import REGISTRY
    from stages.extract.vllm_backend import _run_client, server_args
    from tests.conftest import compose

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    base = [*a.overrides, "run.stages=[prepare,extract]"]
    inproc = run_job(compose([*base, "extract=transformers"]), stages=REGISTRY)
    m = inproc.results["extract"].metrics
    _line("in_process", {"tokens": m["tokens"], "tokens_per_s": m["tokens_per_s"]})
    rows = datasets.load_from_disk(str(inproc.results["prepare"].path / "dataset"))
    ids = [list(map(int, r)) for r in rows.with_format(None)["input_ids"]]
    tokens = sum(len(r) for r in ids)

    cfg = typed(compose([*base, "extract=vllm"]))
    facts = inproc.target.facts
    work = Path(tempfile.mkdtemp(prefix="vllm-extract-bench-"))
    try:
        requests = work / "requests"
        datasets.Dataset.from_dict({"input_ids": ids}).with_format("torch").save_to_disk(
            str(requests)
        )
        staging = work / "staging"
        staging.mkdir()
        args = server_args(cfg, facts, staging)
        with serve(cfg, facts.path, args, work / "vllm.log", label="bench") as server:
            _line("server", {"start_s": server.start_s, "args": args})
            for c in a.concurrency:
                out = work / f"out-{c}"
                t0 = time.time()
                # The stage's own client call, at this concurrency.
                _run_client(server, requests, out, cfg, None, concurrency=c)
                s = time.time() - t0
                _line(
                    f"vllm_c{c}",
                    {
                        "rows": len(ids),
                        "seconds": s,
                        "rows_per_s": len(ids) / s,
                        "tokens_per_s": tokens / s,
                        "ratio_to_in_process": tokens / s / m["tokens_per_s"],
                        "files": len(list(out.glob("hs_*.safetensors"))),
                    },
                )
                shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
