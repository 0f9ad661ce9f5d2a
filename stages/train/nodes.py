"""Training on several nodes (hardware.num_nodes > 1): which node this is, where the nodes meet,
and what every node after the first does.

One runner job runs on each node, with the same config and the same run.output_root on storage
every node sees (docs/multi-box.md):
- node 0 (the leader) runs the pipeline as on one box; its train stage starts torchrun with a
  c10d rendezvous (`--nnodes N --rdzv_backend c10d --rdzv_endpoint HOST:PORT --rdzv_id ...`) and
  writes the training request, marked open, into the train stage's work folder;
- every other node (a follower) plans the same run (the train stage's key, hence its work
  folder, comes from the config alone), waits for that open request, runs its share of the ranks
  with the same rendezvous, and ends when they do. It starts no server and no MLflow run: the
  store and the run are the leader's.

Which node: hardware.node_rank, else the task's rank under submitit (Slurm's launcher runs one
task per node: hydra/launcher=slurm), else 0. Where: hardware.rdzv_endpoint, else the first
node of the Slurm allocation (submitit's hostnames) on port 29400.

Stops and failures are the one-node ones: a stop signal on any node reaches its ranks, which
checkpoint at the next step boundary together; a node that dies (kill -9) fails the others'
collectives, every node's torchrun exits, nothing is published, and the same commands on every
node resume from the last checkpoint.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from runner.core.errors import StageError
from runner.core.schema import RunnerConfig
from runner.processes.cluster import Rendezvous, node_rank
from stages.train.settings import train_ranks

log = logging.getLogger("runner")
REQUEST = "request.json"


def open_request(work: Path, request: dict[str, Any], rdzv: Rendezvous, attempt: int) -> Path:
    """The leader's training request, open for the followers to join (attempt: the train
    stage's attempt count, so that a follower never joins an earlier attempt's request)."""
    path = work / REQUEST
    body = {**request, "rendezvous": rdzv.__dict__, "attempt": attempt, "open": True}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body))
    tmp.replace(path)
    return path


def close_request(work: Path) -> None:
    path = work / REQUEST
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    body["open"] = False
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body))
    tmp.replace(path)


def wait_for_request(work: Path, published: Path, timeout_s: float) -> dict[str, Any] | None:
    """A follower's wait: the leader's open request (returned), or None once the train stage is
    published (nothing to join). Raises StageError after `timeout_s`."""
    deadline = time.time() + timeout_s
    next_note = time.time() + 60
    while time.time() < deadline:
        if (published / "manifest.json").is_file():
            return None
        try:
            body = json.loads((work / REQUEST).read_text())
        except (OSError, ValueError):
            body = None
        if body and body.get("open") and body.get("rendezvous"):
            return body
        if time.time() >= next_note:
            log.info("[train:follower] waiting for the leader's training to start (%s)", work)
            next_note = time.time() + 300
        time.sleep(1.0)
    raise StageError(
        f"the first node did not start training within {timeout_s:.0f} s "
        f"(hardware.node_wait_s); nothing appeared in {work / REQUEST}"
    )


def follow(cfg: RunnerConfig, train: Any, store: Any) -> None:
    """What a node after the first does for the train stage (`Stage.follow`): wait for the
    leader's training of this plan, run this node's ranks in it, and return when they end
    (StageError if they failed). `train` is the stage's planned item."""
    from runner.processes.launch import run_ranks

    rank = node_rank(cfg)
    if train.action != "run":
        log.info(
            "[train:node%d] training is %s in this plan: nothing for this node to do",
            rank,
            train.action,
        )
        return
    work, published = store.scratch("train", train.key), store.path("train", train.key)
    log.info(
        "[train:node%d] node %d of %d: waiting for node 0 to start training (%s)",
        rank,
        rank,
        cfg.hardware.num_nodes,
        work,
    )
    body = wait_for_request(work, published, cfg.hardware.node_wait_s)
    if body is None:
        log.info("[train:node%d] node 0 published the training: nothing to join", rank)
        return
    rdzv = Rendezvous(**body["rendezvous"])
    log.info(
        "[train:node%d] joining attempt %d at %s with %d rank(s)",
        rank,
        body["attempt"],
        rdzv.endpoint,
        train_ranks(cfg),
    )
    # This node's log, outside the leader's work folder (published and removed by the leader).
    logs = work.parent / f"{work.name}-node{rank}"
    code, stopped_by, tail = run_ranks(
        "runner.integrations.speculators_worker",
        work / REQUEST,
        train_ranks(cfg),
        logs / f"train_attempt{body['attempt']}.log",
        label=f"train:node{rank}",
        stop_timeout_s=cfg.train.stop_timeout_s,
        echo=lambda line: "speculators.metrics" not in line,
        rendezvous=rdzv.torchrun_args(),
    )
    if code != 0:
        raise StageError(
            f"this node's training ranks (node {rank} of {cfg.hardware.num_nodes}) ended with "
            f"torchrun exit {code}{f' after {stopped_by}' if stopped_by else ''}; {tail}\n"
            "Run the same command on every node again: training resumes from its latest "
            "checkpoint."
        )
    log.info("[train:node%d] this node's ranks finished", rank)
