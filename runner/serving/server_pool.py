"""Several vLLM servers for one stage: data-parallel extraction (docs/multi-box.md).

    with serve_pool(cfg, model_path, args_for, logs_dir, label="extract") as servers:
        ...  # servers: a list of VllmServer / ExistingServer, at least one

Which servers, from `hardware.vllm`:
- `endpoints: [http://a:8000, http://b:8000]`: servers that already run (other boxes, other
  allocations). Each is asked for /health and its model now; one that does not answer is left
  out with a warning (its share goes to the others) and the stage fails only when none does.
  The plan has already checked each through its API (runner/engine/preflight.py).
- `data_parallel: N` (N > 1): N servers started here side by side, each on its own
  `tensor_parallel_size` GPUs (CUDA_VISIBLE_DEVICES slices of the visible ones; on a CPU they
  share the cores, which only tests the path), each writing to its own staging folder
  (`args_for(k)`). They start together and the stage waits for all of them.
- otherwise the one server `runner.serving.vllm_server.serve` gives (`endpoint`, or one started
here).

Why not vLLM's own `--data-parallel-size`: with it one dead engine ends the whole server, and
the runner could neither resume a shard elsewhere nor say what each engine did; and the
hidden-states connector is documented for one engine (vLLM PR #33736). Separate servers behind
one queue of rows (runner/integrations/vllm_hidden_states_client.py) give failover and a share
per server in the manifest.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from runner.core.errors import StageError
from runner.core.schema import RunnerConfig
from runner.serving.vllm_server import ExistingServer, ServerError, VllmServer, serve

log = logging.getLogger("runner")


def server_count(cfg: RunnerConfig) -> int:
    """How many servers an extraction of this config uses."""
    v = cfg.hardware.vllm
    if v.endpoints:
        return len(v.endpoints)
    return 1 if v.endpoint else v.data_parallel


def gpu_slices(cfg: RunnerConfig) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each managed server: consecutive tensor_parallel_size GPUs of
    the visible ones (a Slurm allocation's, or 0 .. num_gpus-1); None each on a CPU."""
    hw = cfg.hardware
    n = hw.vllm.data_parallel
    if hw.device != "cuda":
        return [None] * n
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else []
    ids = ids or [str(i) for i in range(hw.num_gpus)]
    tp = hw.tensor_parallel_size
    return [",".join(ids[k * tp : (k + 1) * tp]) for k in range(n)]


def answers(server: VllmServer | ExistingServer) -> bool:
    """Whether the server still answers /health (its process alive, for one started here)."""
    try:
        server.check_alive()
    except StageError:
        return False
    return server.healthy()


@contextlib.contextmanager
def serve_pool(
    cfg: RunnerConfig,
    model_path: str,
    args_for: Callable[[int], Sequence[str]],
    logs_dir: Path,
    label: str,
    existing: bool = True,
) -> Iterator[list[VllmServer | ExistingServer]]:
    """The stage's servers (see the module docstring), ready; every one started here is
    stopped when the block ends, whatever ends it. `existing=False`: always servers started
    here (a generating stage: an endpoint serves another configuration)."""
    v = cfg.hardware.vllm
    if existing and v.endpoints:
        yield _existing(v.endpoints, label)
        return
    if v.data_parallel <= 1 or (existing and v.endpoint):
        log_path = logs_dir / f"vllm_{label}.log"
        if existing:
            with serve(cfg, model_path, list(args_for(0)), log_path, label) as s:
                yield [s]
        else:
            with VllmServer.from_config(cfg, model_path, list(args_for(0)), log_path, label) as s:
                yield [s]
        return
    with contextlib.ExitStack() as stack:
        servers = []
        for k, gpus in enumerate(gpu_slices(cfg)):
            server = VllmServer.from_config(
                cfg,
                model_path,
                list(args_for(k)),
                logs_dir / f"vllm_{label}_{k}.log",
                label=f"{label}:{k}",
                env={"CUDA_VISIBLE_DEVICES": gpus} if gpus is not None else None,
            )
            stack.callback(server.stop)  # registered before it starts: stopped on any exit
            server.start()
            servers.append(server)
        for server in servers:  # they load side by side; each wait names its own timeout
            server.wait_ready()
        log.info(
            "[%s] %d vLLM servers ready (hardware.vllm.data_parallel), in %s s",
            label,
            len(servers),
            " / ".join(f"{s.start_s:.0f}" for s in servers),
        )
        yield servers


def _existing(endpoints: Sequence[str], label: str) -> list[VllmServer | ExistingServer]:
    """hardware.vllm.endpoints: the ones that answer now; a warning for each that does not."""
    up: list[VllmServer | ExistingServer] = []
    for k, url in enumerate(endpoints):
        server = ExistingServer(url, f"{label}:{k}")
        try:
            server.__enter__()
        except ServerError as exc:
            log.warning(
                "[%s] left out: %s (hardware.vllm.endpoints[%d]); the other servers take its share",
                label,
                exc,
                k,
            )
            continue
        up.append(server)
    if not up:
        raise StageError(
            f"none of the {len(endpoints)} servers of hardware.vllm.endpoints answers /health: "
            f"{', '.join(endpoints)}"
        )
    return up
