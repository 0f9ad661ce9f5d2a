"""The online hidden-state service: a vLLM server that hands training each sample's hidden
states as it asks (extract.mode=online), instead of files extracted once.

    with hidden_state_server(ctx, server_args) as server:   # None when offline
        ... speculators' trainer fetches from server.url ...

It starts the target with the extraction's flags (`server_args`, from the extract stage), or
uses hardware.vllm.endpoint; probes sample 0 before training (its file must be readable here,
with one slot per capture id and the prepared token ids); records what it served in the
manifest (`served`); and, in a multirun, stays up for the sweep's next job
(runner/serving/shared_servers.py). `serving_gpus` says which GPUs of the box it takes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from runner.assets.target_facts import ModelFacts
from runner.core.errors import StageError
from runner.core.schema import RunnerConfig
from runner.engine.stage import Plan, StageContext
from runner.serving import shared_servers
from runner.serving.vllm_server import serve
from stages.train.settings import serves_while_training, train_ranks

log = logging.getLogger("runner")


def serving_gpus(cfg: RunnerConfig) -> list[str] | None:
    """Online on a GPU box: the GPUs the train stage's server gets (the last
    tensor_parallel_size of the visible ones); training takes the first train_ranks(cfg)."""
    hw = cfg.hardware
    if hw.device != "cuda" or not serves_while_training(cfg):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else []
    ids = ids or [str(i) for i in range(hw.num_gpus)]
    if cfg.extract.share_gpu is not None:  # the first GPUs, which training uses as well
        return ids[: hw.tensor_parallel_size]
    return ids[-hw.tensor_parallel_size :]


def sharing_args(cfg: RunnerConfig, args: list[str]) -> list[str]:
    """extract.share_gpu: the server's memory fraction is that, whatever hardware says, so
    that training on the same GPUs has the rest."""
    if cfg.extract.share_gpu is None or cfg.hardware.device != "cuda":
        return args
    out = list(args)
    i = out.index("--gpu-memory-utilization")
    out[i + 1] = str(cfg.extract.share_gpu)
    return out


def probe(ctx: StageContext, server: Any) -> dict[str, Any]:
    """Sample 0 through the server before training: its file must be readable here and hold one
    slot per capture id, with the prepared token ids. Returns what it saw."""
    import datasets  # slow imports: only an online run
    import openai
    from hs_connectors import FP8Transfer
    from speculators.data_generation.vllm_client import generate_hidden_states

    cfg, facts = ctx.cfg, ctx.facts
    data = datasets.load_from_disk(str(ctx.inputs["prepare"].path / "dataset"))
    ids = [int(i) for i in data.with_format(None)[0]["input_ids"]]
    client = openai.OpenAI(base_url=server.url, api_key="EMPTY", max_retries=0)
    t0 = time.time()
    try:
        handle, params = generate_hidden_states(
            client, server.model_id, {"input_ids": ids}, timeout=cfg.extract.request_timeout_s
        )
    except Exception as exc:
        server.check_alive()
        raise StageError(
            f"online training: the server at {server.url} did not return hidden states for "
            f"sample 0 ({type(exc).__name__}: {exc}); see {server.log_path}"
        ) from None
    where = params.get("hidden_states_path") or params.get("handle") or handle
    sample = FP8Transfer(Path(".")).get_generated(params)
    if sample is None:
        raise StageError(
            f"online training: the server wrote sample 0's hidden states to {where}, which this "
            "machine cannot read; the server's hidden-state folder (its --kv-transfer-config "
            "shared_storage_path) must be on a filesystem both machines share"
        )
    Path(where).unlink(missing_ok=True)
    got = tuple(sample["hidden_states"].shape)
    want = len(facts.extract_ids)
    if len(got) != 3 or got[0] != len(ids) or got[1] != want:
        raise StageError(
            f"online training: the server returned hidden states of shape {got} for sample 0; "
            f"this run needs [{len(ids)}, {want}, hidden]: {want} slots for capture ids "
            f"{list(facts.extract_ids)} (model.capture_layers; with hardware.vllm.endpoint, the "
            "server's eagle_aux_hidden_state_layer_ids)"
        )
    if sample["token_ids"].tolist() != ids:
        raise StageError(
            "online training: the server's token ids for sample 0 differ from the prepared ones; "
            "it serves another tokenizer (hardware.vllm.endpoint)"
        )
    return {"probe_s": time.time() - t0, "probe_shape": list(got)}


@contextlib.contextmanager
def hidden_state_server(
    ctx: StageContext, server_args: Callable[[RunnerConfig, ModelFacts, Path], list[str]]
) -> Iterator[Any]:
    """extract.mode=online: the server speculators fetches from (started here with
    `server_args`, the extraction's own flags, or hardware.vllm.endpoint), checked with sample
    0 and stopped when the block ends; in a multirun it stays up for the next job
    (runner/serving/shared_servers.py). Offline: None."""
    if ctx.cfg.extract.mode != "online":
        yield None
        return

    cfg, facts = ctx.cfg, ctx.facts
    gpus = serving_gpus(cfg)
    env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus else None
    shared = shared_servers.in_multirun() and not cfg.hardware.vllm.endpoint
    if shared:
        # One folder per distinct server, outside any job's work folder (each job's is removed
        # when it succeeds, while the server lives on).
        key = hashlib.sha256(
            json.dumps([facts.path, server_args(cfg, facts, Path("-")), env]).encode()
        ).hexdigest()[:16]
        home = ctx.scratch.parent / f"online-server-{key}"
    else:
        key, home = "", ctx.scratch  # where the server writes; speculators deletes each file
    staging = home / "online_states"
    if not (shared and shared_servers.running(key)):
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    args = sharing_args(cfg, server_args(cfg, facts, staging))

    def start() -> Any:
        return serve(
            cfg, facts.path, args, home / "logs" / "vllm_online.log", label="train:online", env=env
        )

    with contextlib.ExitStack() as stack:
        if shared:
            server, reused = shared_servers.get(key, start)
        else:
            server, reused = stack.enter_context(start()), False
        seen = probe(ctx, server)
        ctx.manifest["served"] = {
            "url": server.url,
            "endpoint": cfg.hardware.vllm.endpoint,
            "server_args": None if cfg.hardware.vllm.endpoint else args,
            "gpus": gpus,
            "capture_ids": list(facts.extract_ids),
            "vllm": server.version(),
            "start_s": 0.0 if reused else server.start_s,
            "shared_by_sweep": shared,
            "reused": reused,
            **seen,
        }
        log.info(
            "[train] online: fetching hidden states from %s%s (sample 0: %s in %.1f s)",
            server.url,
            " (the sweep's server, already running)" if reused else "",
            seen["probe_shape"],
            seen["probe_s"],
        )
        yield server
        if shared and isinstance(server.log_path, Path):
            # The shared server's log so far, with this job's artifact.
            (ctx.scratch / "logs").mkdir(parents=True, exist_ok=True)
            shutil.copy2(server.log_path, ctx.scratch / "logs" / "vllm_online.log")


def plan_online(p: Plan, cfg: RunnerConfig) -> None:
    """Online: which GPUs serve and which train; a box that cannot hold both is refused."""
    hw = cfg.hardware
    if hw.vllm.endpoint:
        p.add("online", f"hidden states fetched from {hw.vllm.endpoint} (hardware.vllm.endpoint)")
        return
    if hw.device != "cuda":
        p.add("online", "the train stage's vLLM server and training share this machine's CPUs")
        return
    tp, n, ranks = hw.tensor_parallel_size, hw.num_gpus, train_ranks(cfg)
    share = cfg.extract.share_gpu
    if share is not None:
        gpus = serving_gpus(cfg) or []
        p.add(
            "online",
            f"vLLM serves on GPU(s) {','.join(gpus)} (TP {tp}) with {share:.0%} of their memory "
            f"(extract.share_gpu); training on the first {ranks} of the visible GPUs shares "
            f"them, with the other {1 - share:.0%}",
        )
        return
    if tp + ranks > n or n - tp < 1:
        key = "train.num_gpus" if cfg.train.num_gpus is not None and n - tp >= 1 else "extract.mode"
        p.error(
            key,
            f"online training serves the target on {tp} GPU(s) (hardware.tensor_parallel_size) "
            f"and trains on {ranks}, but hardware '{hw.name}' has {n}: "
            + (
                f"lower train.num_gpus to {n - tp}"
                if key == "train.num_gpus"
                else "no GPU is left to train on. Share them (extract.share_gpu=0.3 gives the "
                "server 30% of each GPU's memory and training the rest), extract offline "
                "instead (extract.mode=offline, extract.storage=fp8 halves the disk), or serve "
                "on another machine and point hardware.vllm.endpoint at it "
                "(docs/multi-box.md: two boxes)"
            ),
        )
        return
    gpus = serving_gpus(cfg) or []
    p.add(
        "online",
        f"vLLM serves on GPU(s) {','.join(gpus)} (TP {tp}); training on the first {ranks} of "
        "the visible GPUs",
    )
