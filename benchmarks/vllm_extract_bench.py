"""vLLM extraction against in-process extraction on the same rows, measured in one run: where the
vLLM path's time goes as the requests in flight, the client and the server's step size change.

For each step size (`--batch-tokens`, extract.batch_tokens; `0`: the config's default) one
extraction server is started with the extract stage's own flags (`stages.extract.vllm_backend.
server_args`); for each concurrency the same prepared rows are sent by each client, each pass into
a fresh folder: `runner` is the stage's own request loop (runner/integrations/
vllm_hidden_states_client.py), `speculators` speculators' data-generation client, which the stage
used before. The in-process (transformers) backend extracts the same rows once. Every figure is
one `BENCH` JSON line: rows/s, tokens/s, the ratio to in process, and CPU milliseconds per row in
the client (this process), the server's API process and its engine core (whichever is near 1.0
CPU-second per second, `cpu_busy`, is the bound), and the states' bytes a second against what the
same filesystem takes for files of the same sizes written the same way (`ratio_to_disk`).

Usage (runner overrides after `--`; the prepared rows come from the runner's store, computed if
missing):
    python -m benchmarks.vllm_extract_bench --concurrency 64 --clients runner speculators \
        --batch-tokens 2049 16384 -- hardware=gpu1 data.num_samples=1500
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path


def _line(name: str, values: dict) -> None:
    print(f"BENCH {name} {json.dumps(values)}", flush=True)


def _speculators_client(server, requests: Path, out: Path, concurrency: int) -> None:
    """speculators' data-generation client over the same rows (what the stage used before)."""
    from speculators.cli.generate_offline_data import generate_offline_data

    generate_offline_data(
        model=server.model_id,
        endpoint=server.url,
        preprocessed_data=str(requests),
        output=str(out),
        concurrency=concurrency,
        validate_outputs=False,
    )


def _cpu(server) -> dict[str, float]:
    """CPU seconds so far: the client (this process) and each kind of server process (API
    server, engine core, workers)."""
    import psutil

    me = resource.getrusage(resource.RUSAGE_SELF)
    out = {"client": me.ru_utime + me.ru_stime}
    top = psutil.Process(server.pid)
    for p in [top, *top.children(recursive=True)]:
        try:
            name = "api_server" if p.pid == top.pid else p.name().split("::")[-1].lower()
            t = p.cpu_times()
            out[name] = out.get(name, 0.0) + t.user + t.system
        except psutil.Error:
            continue
    return out


def _disk_write_rate(folder: Path, files: list[Path]) -> float:
    """Bytes a second this filesystem takes when the same number of safetensors files of the
    same sizes as an extraction's are written the way the stage writes them (save_file, through
    the page cache): the bound when the states, not the server, are the limit."""
    from safetensors.torch import load_file, save_file

    sizes = [f.stat().st_size for f in files]
    sample = load_file(str(files[0]))["hidden_states"]
    folder.mkdir(exist_ok=True)
    t0 = time.time()
    for i, size in enumerate(sizes):
        n = max(1, size // (sample.element_size() * sample.shape[-1]))
        save_file({"x": sample.new_zeros((n, sample.shape[-1]))}, str(folder / f"{i}.safetensors"))
    rate = sum(sizes) / (time.time() - t0)
    shutil.rmtree(folder)
    return rate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64])
    ap.add_argument(
        "--clients", nargs="+", choices=["runner", "speculators"], default=["runner", "speculators"]
    )
    ap.add_argument("--batch-tokens", type=int, nargs="+", default=[0])
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)

    import datasets

    from runner.composition import compose_root

    compose_root()
    from runner.core.schema import typed
    from runner.engine.job import run_job
    from runner.serving.hidden_states import server_args
    from runner.serving.vllm_server import serve
    from stages import REGISTRY
    from stages.extract.vllm_backend import fetch
    from tests.conftest import compose

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    base = [*a.overrides, "run.stages=[prepare,extract]"]
    inproc = run_job(compose([*base, "extract=transformers"]), stages=REGISTRY)
    m = inproc.results["extract"].metrics
    _line("in_process", {"tokens": m["tokens"], "tokens_per_s": m["tokens_per_s"]})
    rows = datasets.load_from_disk(str(inproc.results["prepare"].path / "dataset"))
    ids = [list(map(int, r)) for r in rows.with_format(None)["input_ids"]]
    tokens = sum(len(r) for r in ids)

    facts = inproc.target.facts
    work = Path(tempfile.mkdtemp(prefix="vllm-extract-bench-"))
    try:
        requests = work / "requests"
        datasets.Dataset.from_dict({"input_ids": ids}).with_format("torch").save_to_disk(
            str(requests)
        )
        for step in a.batch_tokens:
            over = [f"extract.batch_tokens={step}"] if step else []
            cfg = typed(compose([*base, "extract=vllm", *over]))
            staging = work / "staging"
            staging.mkdir(exist_ok=True)
            args = server_args(cfg, facts, staging)
            with serve(cfg, facts.path, args, work / "vllm.log", label="bench") as server:
                _line("server", {"start_s": server.start_s, "args": args})
                for c in a.concurrency:
                    for k in a.clients:
                        out = work / f"out-{c}-{k}"
                        before = _cpu(server)
                        t0 = time.time()
                        if k == "runner":  # the stage's own call
                            fetch(server, dict(enumerate(ids)), out, cfg, concurrency=c)
                        else:
                            _speculators_client(server, requests, out, c)
                        s = time.time() - t0
                        cpu = {n: (v - before.get(n, 0.0)) for n, v in _cpu(server).items()}
                        written = sorted(out.glob("hs_*.safetensors"))
                        state_bytes = sum(f.stat().st_size for f in written)
                        disk = _disk_write_rate(work / "disk", written) if written else 0.0
                        _line(
                            f"vllm_step{step}_c{c}_{k}",
                            {
                                "rows": len(ids),
                                "seconds": s,
                                "rows_per_s": len(ids) / s,
                                "tokens_per_s": tokens / s,
                                "ratio_to_in_process": tokens / s / m["tokens_per_s"],
                                "files": len(written),
                                "state_bytes_per_s": state_bytes / s,
                                "disk_bytes_per_s": disk,
                                "ratio_to_disk": state_bytes / s / disk if disk else None,
                                "cpu_ms_per_row": {
                                    n: round(1000 * v / len(ids), 2) for n, v in cpu.items()
                                },
                                "cpu_busy": {n: round(v / s, 2) for n, v in cpu.items()},
                            },
                        )
                        shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
