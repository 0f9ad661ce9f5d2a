"""Adapter to vLLM internals (checked against vLLM 0.32.0): its hidden-states connector on CPU.
Loaded by the vLLM server (kv_connector_module_path), never by the runner: it imports vLLM.

Private APIs touched: `ExampleHiddenStatesConnector._submit_async_write` (overridden) and the
attributes and helpers it uses (`_is_tp_rank_zero`, `_kv_cache`, `_block_size`, `_lock_fds`,
`use_lock`, `_executor`, `_write_tensors`, `_req_copy_events`, `_req_futures`,
`_on_write_done`, `PendingSave`, `extract_from_kv_cache`).

vLLM's `ExampleHiddenStatesConnector` writes each finished request's captured hidden states to
a safetensors file, but its write path is CUDA-only: a side `torch.cuda.Stream`, pinned host
memory and a `torch.cuda.Event` that `get_finished` polls. On a CPU engine the cache already
lives in host memory, so this subclass gathers the request's rows synchronously and hands the
write thread an always-ready event. Everything else (lock files, file names, scheduler side) is
vLLM's own. The extract stage selects it only when `hardware.device` is `cpu`, through
`kv_transfer_config.kv_connector_module_path = "runner.integrations.vllm_cpu_connector"`.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

__all__ = ["CpuHiddenStatesConnector"]


class _Ready:
    """Stands in for the CUDA event of a device-to-host copy that, on CPU, has already happened."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (blocks[:, None] * self._block_size + offsets[None, :]).flatten()
        # Advanced indexing copies, so later writes into the cache cannot reach this tensor.
        hidden = extract_from_kv_cache(self._kv_cache, slot_mapping, pending.token_ids.shape[0])
        tensors = {"hidden_states": hidden.contiguous(), "token_ids": pending.token_ids.clone()}
        assert pending.req_id not in self._req_futures, (
            "Found another KV transfer request with same req_id!"
        )
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(
                pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644
            )
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        ready = _Ready()
        future = self._executor.submit(
            self._write_tensors, tensors, ready, pending.filename, lock_fd
        )
        self._req_copy_events[pending.req_id] = ready
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
