"""Which node of a cluster this process is, and where the nodes meet (hardware.num_nodes > 1).

Which node: hardware.node_rank, else the task's rank under submitit (Slurm's launcher runs one
task per node: hydra/launcher=slurm), else 0. Where: hardware.rdzv_endpoint, else the first
node of the Slurm allocation (submitit's hostnames) on port 29400. The engine asks
`is_follower`; a stage whose work spans nodes (train) meets the others at `rendezvous`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from runner.core.schema import RunnerConfig

DEFAULT_PORT = 29400


@dataclass(frozen=True)
class Rendezvous:
    """The torchrun arguments every node passes: same count, endpoint and id."""

    nnodes: int
    endpoint: str
    run_id: str

    def torchrun_args(self) -> list[str]:
        return [
            f"--nnodes={self.nnodes}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={self.endpoint}",
            f"--rdzv_id={self.run_id}",
        ]


def _submitit() -> Any:
    """submitit's view of this task when it runs under a submitit launcher, else None."""
    if not any(k in os.environ for k in ("SUBMITIT_EXECUTOR", "SUBMITIT_LOCAL_JOB_ID")):
        return None
    try:
        import submitit

        return submitit.JobEnvironment()
    except Exception:  # not inside a submitit job after all
        return None


def node_rank(cfg: RunnerConfig) -> int:
    if cfg.hardware.node_rank is not None:
        return cfg.hardware.node_rank
    env = _submitit()
    return int(env.global_rank) if env is not None and cfg.hardware.num_nodes > 1 else 0


def is_follower(cfg: RunnerConfig) -> bool:
    return cfg.hardware.num_nodes > 1 and node_rank(cfg) > 0


def rendezvous(cfg: RunnerConfig, run_id: str) -> Rendezvous:
    endpoint = cfg.hardware.rdzv_endpoint
    if not endpoint:
        env = _submitit()
        hosts = list(getattr(env, "hostnames", None) or []) if env is not None else []
        endpoint = f"{hosts[0] if hosts else '127.0.0.1'}:{DEFAULT_PORT}"
    return Rendezvous(cfg.hardware.num_nodes, endpoint, run_id)
