"""The managed vLLM server's life cycle: ready, logged, stopped with everything it started, and
failures that end with the reason and the log's tail instead of a hang.

The first tests launch a stand-in through `hardware.vllm.command` (the knob users point at another
install or a container): a small HTTP server that also starts a child, so that "no orphans" can be
checked in seconds. The last launches the real vLLM with a flag it rejects.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

from runner.core.schema import typed
from runner.serving.vllm_server import ServerError, VllmServer, guarded, spec_decode_counters
from tests.conftest import compose

# Serves /health and /v1/models after `delay` seconds, or exits with `code`; starts a grandchild
# (like vLLM's engine process) and prints the pids.
STAND_IN = r"""
import http.server, json, subprocess, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
mode = sys.argv[1]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(f"pids {__import__('os').getpid()} {child.pid}", flush=True)
if mode.startswith("exit"):
    # vLLM's root cause comes first, then more traceback than the tail the error shows.
    print("AssertionError: Tried to load weights of size [576, 2304]", flush=True)
    for i in range(60):
        print(f'  File "engine.py", line {i}, in start', flush=True)
    print("RuntimeError: Engine core initialization failed. See root cause above.", flush=True)
    print("boom: engine core failed to start", flush=True)
    sys.exit(int(mode[4:]))
if mode == "hang":
    time.sleep(600)
time.sleep(1)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        models = {"data": [{"id": "stand-in"}]}
        body = b"{}" if self.path == "/health" else json.dumps(models).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): print("GET", self.path, flush=True)
httpd = http.server.HTTPServer(("127.0.0.1", port), H)
if mode == "deaf":  # as an API server shutting down: it stops listening, its process stays
    import threading
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    time.sleep(4)
    httpd.shutdown(); httpd.server_close()
    time.sleep(600)
httpd.serve_forever()
"""


def _server(tmp_path, mode: str, timeout_s: int = 60) -> VllmServer:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    cfg = typed(
        compose(
            [
                f"hardware.vllm.command=[{sys.executable},{script},{mode}]",
                f"hardware.vllm.ready_timeout_s={timeout_s}",
                "hardware.vllm.stop_timeout_s=5",
            ]
        )
    )
    return VllmServer.from_config(
        cfg, "/models/target", ["--dtype", "bfloat16"], tmp_path / "logs" / "vllm.log", label="test"
    )


def _pids(server: VllmServer) -> list[int]:
    for _ in range(100):
        for line in server.log_path.read_text().splitlines():
            if line.startswith("pids "):
                return [int(p) for p in line.split()[1:]]
        time.sleep(0.05)
    raise AssertionError("stand-in never printed its pids")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; only its parent's wait is pending.
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split(")")[-1].split()[0] != "Z"


def _all_end(pids: list[int], within_s: float = 5.0) -> bool:
    """Whether every one of `pids` has exited within `within_s`: a group's SIGKILL is delivered at
    once, but a loaded machine may take a moment to end the processes (seen with the fast suite
    beside other work on 2 cores, for the hanging stand-in's grandchild too)."""
    deadline = time.time() + within_s
    while any(_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    return not any(_alive(p) for p in pids)


def test_server_is_ready_logged_and_stopped_with_its_children(tmp_path):
    server = _server(tmp_path, "serve")
    with server:
        assert server.model_id == "stand-in" and server.start_s is not None and server.start_s < 30
        pids = _pids(server)
        assert all(_alive(p) for p in pids)
        assert "--model /models/target --host 127.0.0.1 --port" in server.log_path.read_text()
    assert _all_end(pids), "the server or its child outlived the runner's stop"


def test_server_stops_when_the_stage_fails(tmp_path):
    server = _server(tmp_path, "serve")
    with pytest.raises(RuntimeError, match="stage failed"), server:
        pids = _pids(server)
        raise RuntimeError("stage failed")
    assert _all_end(pids)


def test_a_server_that_exits_reports_its_code_and_log(tmp_path):
    server = _server(tmp_path, "exit3")
    with pytest.raises(ServerError) as err, server:
        pass
    assert "exited with code 3" in str(err.value) and "boom: engine core failed" in str(err.value)
    # The first error line of the log, which the tail no longer holds, is named up front.
    assert "exited with code 3: AssertionError: Tried to load weights" in str(err.value)


@pytest.mark.parametrize("how", ["killed", "deaf"])
def test_requests_in_flight_end_within_seconds_when_the_server_goes(tmp_path, how):
    """Requests to a server that dies (kill -9: its process exits) or stops listening while its
    process stays (an API server shutting down on SIGTERM) end with the server named within
    seconds, not when each request times out (eval.timeout_s: minutes)."""
    import asyncio
    import signal

    server = _server(tmp_path, "deaf" if how == "deaf" else "serve")
    with server:
        if how == "killed":
            os.kill(_pids(server)[0], signal.SIGKILL)
        t0 = time.time()
        with pytest.raises(ServerError) as err:
            asyncio.run(guarded(server, asyncio.sleep(600)))  # a request that never returns
        assert time.time() - t0 < 20
    said = str(err.value)
    assert ("exited with code -9" in said) if how == "killed" else ("stopped answering" in said)


def test_a_server_that_never_becomes_ready_times_out_and_is_killed(tmp_path):
    server = _server(tmp_path, "hang", timeout_s=3)
    t0 = time.time()
    with (
        pytest.raises(ServerError, match=r"not ready after 3 s \(hardware.vllm.ready_timeout_s\)"),
        server,
    ):
        pass
    assert time.time() - t0 < 20
    assert _all_end(_pids(server))


def test_real_vllm_rejecting_a_flag_fails_with_its_message(tmp_path):
    cfg = typed(compose(["hardware.vllm.extra_args=[--max-model-len,not-a-number]"]))
    server = VllmServer.from_config(cfg, str(tmp_path), [], tmp_path / "vllm.log", label="test")
    with pytest.raises(ServerError) as err, server:
        pass
    text = str(err.value)
    assert (
        "exited with code" in text
        and "max-model-len" in text
        and str(tmp_path / "vllm.log") in text
    )


def test_spec_decode_counters_sum_engines_and_positions():
    # The exposition format vLLM's Prometheus endpoint writes (two engines, three positions).
    text = (
        "\n".join(
            [
                "# TYPE vllm:spec_decode_num_drafts counter",
                'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0',
                'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0',
                "# TYPE vllm:spec_decode_num_draft_tokens counter",
                'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 45.0',
                "# TYPE vllm:spec_decode_num_accepted_tokens counter",
                'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 9.0',
                "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter",
                *[
                    "vllm:spec_decode_num_accepted_tokens_per_pos_total"
                    f'{{engine="{e}",model_name="m",position="{p}"}} {v}'
                    for e, vals in ((0, (4, 2, 1)), (1, (1, 1, 0)))
                    for p, v in enumerate(vals)
                ],
            ]
        )
        + "\n"
    )
    c = spec_decode_counters(text)
    assert c == {"drafts": 15, "draft_tokens": 45, "accepted": 9, "accepted_per_pos": [5, 3, 1]}


def test_vllm_lines_are_shown_in_the_runners_format_and_its_warnings_counted():
    """Its errors always, its milestones while it loads, in the runner's own format (without
    vLLM's process, date and file prefix); its warnings only counted."""
    import logging

    from runner.serving.vllm_server import _echo_line

    warnings: list[str] = []
    warn = "(APIServer pid=990) WARNING 12-02 01:38:25 [system_utils.py:299] Found ulimit of 20000"
    loaded = (
        "(EngineCore pid=1183) INFO 12-02 01:39:46 [default_loader.py:430] "
        "Loading weights took 3.2 seconds"
    )
    error = "(EngineCore pid=1183) ERROR 12-02 01:39:50 [core.py:12] EngineCore failed to start."
    assert _echo_line(warn, ready=False, warnings=warnings) is None and len(warnings) == 1
    assert _echo_line(loaded, ready=False, warnings=warnings) == (
        logging.INFO,
        "Loading weights took 3.2 seconds",
    )
    assert _echo_line(loaded, ready=True, warnings=warnings) is None
    assert _echo_line(error, ready=True, warnings=warnings)[0] == logging.ERROR
    assert _echo_line("Traceback (most recent call last):", True, warnings)[0] == logging.ERROR
    assert _echo_line("INFO:     127.0.0.1 - POST /v1/completions", True, warnings) is None
    assert len(warnings) == 1
