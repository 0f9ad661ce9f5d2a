"""The two speed clients (the evaluate stage's and eval.speed_check's) against a stand-in endpoint
that records what it was sent: what each pass puts on a server, not how fast it goes (their
accuracy against a known rate is benchmarks/speed_clients.py's).
Run: pytest tests/test_speed_clients.py
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from types import SimpleNamespace

import pytest

from benchmarks.speed_clients import TOKENS  # what the stand-in answers with


class StandIn:
    """An OpenAI-style chat endpoint on a thread of its own: each request answered with TOKENS
    tokens after `delay` s, times 1 + i for "prompt i" with `staggered` (short and long
    answers in one batch); it counts requests per prompt, the most in flight at once and the
    connections opened."""

    def __init__(self, delay: float, staggered: bool = False) -> None:
        self.delay, self.staggered = delay, staggered
        self.asked: collections.Counter[str] = collections.Counter()
        self.in_flight = self.most_in_flight = 0
        self.peers: set[tuple] = set()  # one client address and port per connection
        self._up = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()
        assert self._up.wait(10)

    def _serve(self) -> None:
        from benchmarks.speed_clients import serve_stand_in

        def delay_of(prompt: str) -> float:
            return self.delay * (1 + int(prompt.split()[-1]) if self.staggered else 1)

        @contextlib.contextmanager
        def watch(request, prompt: str):
            self.peers.add(request.transport.get_extra_info("peername"))
            self.asked[prompt] += 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            yield
            self.in_flight -= 1

        def ready(port: int) -> None:
            self.base = f"http://127.0.0.1:{port}"
            self._up.set()

        serve_stand_in(0, delay_of, watch, ready)


@pytest.fixture
def stand_in(request):
    return StandIn(delay=0.05, staggered=getattr(request, "param", False))


def _stage_rate(stand_in: StandIn, prompts: list[str], one_at_a_time: bool, pass_s: float):
    from stages.evaluate import serving

    cfg = SimpleNamespace(
        eval=SimpleNamespace(max_new_tokens=TOKENS, timeout_s=60, speed_pass_s=pass_s)
    )
    server = SimpleNamespace(model_id="m", url=f"{stand_in.base}/v1", check_alive=lambda: None)
    return asyncio.run(serving._rate(server, prompts, cfg, one_at_a_time=one_at_a_time))


PROMPTS = [f"prompt {i}" for i in range(8)]


@pytest.mark.parametrize("client", ["stage", "check"])
def test_a_concurrency_1_pass_times_every_prompt_one_at_a_time(stand_in, client):
    from stages.evaluate import speed_check

    if client == "stage":
        rate = _stage_rate(stand_in, PROMPTS, one_at_a_time=True, pass_s=0)
    else:
        rate = speed_check.rate(stand_in.base, "m", PROMPTS, TOKENS, at_once=False)
    assert stand_in.most_in_flight == 1
    # The first answer opens the window; every prompt is then counted at least once.
    assert set(stand_in.asked) == set(PROMPTS) and sum(stand_in.asked.values()) >= len(PROMPTS) + 1
    # A rate over whole requests: at most what the stand-in's delay allows.
    assert 0 < rate <= TOKENS / stand_in.delay


@pytest.mark.parametrize("stand_in", [True], indirect=True)
@pytest.mark.parametrize("client", ["stage", "check"])
def test_a_batch_pass_holds_the_whole_batch_on_the_server_and_reuses_its_connections(
    stand_in, client
):
    from stages.evaluate import speed_check

    if client == "stage":
        rate = _stage_rate(stand_in, PROMPTS, one_at_a_time=False, pass_s=0.5)
    else:
        rate = speed_check.rate(stand_in.base, "m", PROMPTS, TOKENS, at_once=True, min_pass_s=0.5)
    assert stand_in.most_in_flight == len(PROMPTS)
    # Every user sends its next request when its last is answered, no round waiting for the
    # slowest: the shortest answer (0.05 s) is asked for about eight times as often as the
    # longest (0.4 s); rounds would ask for each as often.
    asked = stand_in.asked
    assert asked["prompt 0"] >= 4 * asked["prompt 7"] and asked["prompt 7"] >= 2
    # One connection per user, kept alive (a connection per request would be one per request).
    assert len(stand_in.peers) <= len(PROMPTS)
    # The users' own rates summed: what the stand-in gives, sum of TOKENS / delay_i (a
    # timing figure, so only bounded here; benchmarks/speed_clients.py measures it).
    assert 0 < rate <= sum(TOKENS / (0.05 * (1 + i)) for i in range(len(PROMPTS)))


def test_with_the_check_each_timing_has_the_independent_clients_beside_it():
    """eval.speed_check: the independent client times the same server at the same concurrency
    right beside each of the stage's timings, the two in alternating order, so that both meet
    the same state of the machine (serving._speed)."""
    from stages.evaluate import serving

    stand_ins = {"draft": StandIn(delay=0.01), "target": StandIn(delay=0.01)}
    servers = {
        label: SimpleNamespace(
            model_id="m", base=s.base, url=f"{s.base}/v1", check_alive=lambda: None
        )
        for label, s in stand_ins.items()
    }
    e = SimpleNamespace(
        max_new_tokens=TOKENS, timeout_s=60, speed_pass_s=0, speed_prompts=2, concurrency=[]
    )
    out = serving._speed(servers, PROMPTS[:4], SimpleNamespace(eval=e), repeats=3, check=True)
    timings = []
    for label in servers:
        for who, got in (("stage", out[label]), ("check", out[label]["check"])):
            for kind in ("c1", "batch"):
                assert len(got[kind]) == 3 and all(r > 0 for r in got[kind])
                timings += [(at, label, kind, who) for at in got["at"][kind]]
    timings.sort()
    # In twos: the same server and concurrency, one timing by each client, whose order turns.
    pairs = [timings[i : i + 2] for i in range(0, len(timings), 2)]
    assert all(a[1:3] == b[1:3] and {a[3], b[3]} == {"stage", "check"} for a, b in pairs)
    firsts = [a[3] for a, _ in pairs]
    assert firsts == ["stage", "check"] * (len(pairs) // 2)
    # Without the check, only the stage's timings.
    alone = serving._speed(servers, PROMPTS[:4], SimpleNamespace(eval=e), repeats=2)
    assert "check" not in alone["draft"] and len(alone["target"]["batch"]) == 2


def _server(stand_in: StandIn) -> SimpleNamespace:
    return SimpleNamespace(
        model_id="m", base=stand_in.base, url=f"{stand_in.base}/v1", check_alive=lambda: None
    )


def test_each_concurrency_level_holds_that_many_streams_on_the_server():
    """eval.concurrency: at level n, n closed-loop users share the prompts (more users than
    prompts wrap round), so the server holds n requests; each level is timed on both servers at
    every repeat, and the independent client times only concurrency 1 and the batch."""
    from stages.evaluate import serving

    e = SimpleNamespace(
        max_new_tokens=TOKENS, timeout_s=60, speed_pass_s=0.3, speed_prompts=2, concurrency=[]
    )
    for n in (3, 12):
        stand_in = StandIn(delay=0.02)
        rate = asyncio.run(
            serving._rate(_server(stand_in), PROMPTS, SimpleNamespace(eval=e), False, n)
        )
        assert stand_in.most_in_flight == n and rate > 0
        assert set(stand_in.asked) == set(PROMPTS)
    e.concurrency, e.speed_pass_s = [1, 3, 12], 0
    servers = {label: _server(StandIn(delay=0.01)) for label in ("draft", "target")}
    out = serving._speed(servers, PROMPTS, SimpleNamespace(eval=e), repeats=2, check=True)
    for label in servers:
        assert [k for k, v in out[label].items() if isinstance(v, list)] == [
            "c1",
            "batch",
            "c3",
            "c12",
        ]
        assert all(len(out[label][k]) == 2 for k in ("c1", "batch", "c3", "c12"))
        assert "c3" not in out[label]["check"]


def test_a_set_being_served_prints_how_many_prompts_are_answered(monkeypatch, caplog):
    import logging

    from stages.evaluate import serving

    monkeypatch.setattr(serving, "PROGRESS_EVERY_S", 0.0)
    stand_in = StandIn(delay=0.01)
    e = SimpleNamespace(max_new_tokens=TOKENS, timeout_s=60)
    prompts = PROMPTS[:4]
    with caplog.at_level(logging.INFO, logger="runner"):
        outs = asyncio.run(
            serving._generate_all(
                _server(stand_in), prompts, SimpleNamespace(eval=e), counting="draft: mtbench"
            )
        )
    assert len(outs) == 4
    lines = [r.getMessage() for r in caplog.records if "prompts answered" in r.getMessage()]
    assert lines[0] == "[evaluate] draft: mtbench: 1/4 prompts answered"
    assert len(lines) == 3  # not after the last: the set's own line says it is done
