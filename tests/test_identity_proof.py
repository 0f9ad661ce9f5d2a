"""The identity check's verdicts are proven, not inferred: a divergence past the near-tie filter
is re-read by the target alone in one forward over the prompt and the served tokens, through
vLLM's prompt logprobs. The target picking the served token there proves the divergence the
kernels'; any other rank proves a real mismatch, which fails the run (eval.gates)."""

from __future__ import annotations

import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from stages.evaluate.measures import KERNELS, MISMATCH, NEAR_TIE, gate, proven
from stages.evaluate.serving import rescore


def _reply(handler: BaseHTTPRequestHandler, answer: dict) -> None:
    """Answer a stand-in endpoint's request with `answer` as JSON, as vLLM's server does."""
    data = json.dumps(answer).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


@pytest.fixture
def stand_in():
    """A completions endpoint that answers prompt logprobs as vLLM does, ranking at the last
    prompt position the tokens in `ranking` (likeliest first); it records each request."""
    state = {"ranking": [], "asked": []}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state["asked"].append(body)
            last = {
                str(t): {"logprob": -0.1 * r, "rank": r + 1, "decoded_token": "x"}
                for r, t in enumerate(state["ranking"])
            }
            prompt = body["prompt"]
            answer = {"choices": [{"prompt_logprobs": [None] * (len(prompt) - 1) + [last]}]}
            _reply(self, answer)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    server = SimpleNamespace(url=f"http://127.0.0.1:{httpd.server_port}/v1", model_id="m")
    yield server, state
    httpd.shutdown()


def test_a_divergence_the_target_reproduces_is_the_kernels_and_one_it_does_not_is_real(stand_in):
    server, state = stand_in
    far = {"position": 2, "draft_token": 9, "target_token": 7, "gap": 0.75, "verdict": MISMATCH}
    # In one forward over the prompt and the served tokens the target picks the served 9.
    state["ranking"] = [9, 7, 3]
    got = rescore(server, [1, 2, 3], [5, 6, 9, 4], 2, timeout_s=10)
    assert got == {"rank": 1, "top": 9}
    body = state["asked"][-1]
    assert body["prompt"] == [1, 2, 3, 5, 6, 9] and body["max_tokens"] == 1
    assert body["prompt_logprobs"] >= 1 and body["cache_salt"]  # no cached prefix reused
    kernels = proven(far, got)
    assert kernels["verdict"] == KERNELS and "ranks the served token 1" in kernels["proof"]
    # A token the target never picks: ranked third there, a real mismatch.
    state["ranking"] = [7, 3, 9]
    real = proven(far, rescore(server, [1, 2, 3], [5, 6, 9, 4], 2, timeout_s=10))
    assert real["verdict"] == MISMATCH and real["rescored_rank"] == 3
    # Outside the target's likeliest at all: ranked past them, a mismatch.
    state["ranking"] = [7, 3]
    unranked = proven(far, rescore(server, [1, 2, 3], [5, 6, 9, 4], 2, timeout_s=10))
    assert unranked["verdict"] == MISMATCH and unranked["rescored_rank"] == 3
    # A server that cannot re-read (no prompt logprobs): the filter's verdict, marked unproven.
    assert "unproven" in proven(far, {})["proof"] and proven(far, {})["verdict"] == MISMATCH
    # Near ties pass the filter without a re-reading; the gate fails the run on a mismatch only.
    near = {**far, "gap": 0.25, "verdict": NEAR_TIE}
    assert proven(near, None)["verdict"] == NEAR_TIE
    assert gate({"mismatches": 1, "acceptance_length_ci_high": 1.5}, 1.05, ["mtbench"])
    assert not gate({"mismatches": 0, "acceptance_length_ci_high": 1.5}, 1.05, ["mtbench"])


def test_the_floor_names_each_set_at_or_below_it():
    metrics = {
        "acceptance_length": 1.02,
        "acceptance_length_ci_high": 1.04,
        "humaneval/acceptance_length": 1.4,
        "humaneval/acceptance_length_ci_high": 1.5,
    }
    found = gate(metrics, 1.05, ["mtbench", "humaneval"])
    assert len(found) == 1 and found[0].startswith("mtbench: acceptance length 1.020")
    assert "FLASHINFER_MLA" in found[0]
    assert not gate(metrics, None, ["mtbench", "humaneval"])


def test_a_mismatch_served_again_alone_is_told_transient_or_reproduced():
    """A proven mismatch's prompt served again alone on a fresh draft server: following the
    target through the mismatch's position, it did not repeat (transient); the same token
    there, reproduced; leaving the path earlier, still a mismatch with where it left."""
    from stages.evaluate.measures import TRANSIENT, identity_counts, rechecked

    target = [5, 6, 7, 8, 2]
    d = {"position": 2, "draft_token": 9, "target_token": 7, "gap": 1.6, "verdict": MISMATCH}
    d = {**d, "proof": "the target ... ranks the served token 2"}
    once = rechecked(d, [5, 6, 7, 8, 2], target)
    assert once["verdict"] == TRANSIENT and "not repeated" in once["proof"]
    # Parting after the position (a near tie later) still followed the target through it.
    assert rechecked(d, [5, 6, 7, 3], target)["verdict"] == TRANSIENT
    again = rechecked(d, [5, 6, 9, 8], target)
    assert again["verdict"] == MISMATCH and again["reproduced"] is True
    earlier = rechecked(d, [5, 4, 7, 8], target)
    assert earlier["verdict"] == MISMATCH and "position 1" in earlier["proof"]
    # Stopping before the position is not following the target through it.
    assert rechecked(d, [5, 6], target)["verdict"] == MISMATCH
    counts = identity_counts({"mtbench": [once, again, None]})
    assert counts["transient_mismatches"] == 1 and counts["mismatches"] == 1


@pytest.mark.parametrize(
    ("overrides", "fails", "warns"),
    [
        ([], 0, 1),  # the CPU default: a transient mismatch warns
        (["eval.transient_mismatches=fail"], 1, 0),
        (["hardware=gpu1"], 1, 0),  # on a GPU it fails the run
        (["hardware=gpu1", "eval.transient_mismatches=warn"], 0, 1),
        (["hardware=gpu1", "eval.gates=warn"], 0, 1),
    ],
)
def test_a_transient_mismatch_fails_on_a_gpu_and_warns_on_a_cpu(overrides, fails, warns):
    from stages.evaluate import STAGE
    from tests.conftest import compose

    cfg = compose(overrides)
    metrics = {"transient_mismatches": 1, "acceptance_length_ci_high": 1.5}
    failed, warned = STAGE.gate(metrics, cfg)
    assert (len(failed), len(warned)) == (fails, warns)
    assert all("served again alone" in g for g in failed + warned)
    # A reproduced mismatch fails the run wherever it is served, unless gates warn.
    failed, warned = STAGE.gate({**metrics, "mismatches": 1, "transient_mismatches": 0}, cfg)
    assert len(failed) == (0 if "eval.gates=warn" in overrides else 1)


@pytest.fixture
def chat_stand_in():
    """A chat-completions endpoint that answers as vLLM does with `return_token_ids`: each
    prompt's generated ids from `answers` (by the prompt's text); it records each request."""
    state = {"answers": {}, "asked": []}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            _reply(self, {"data": [{"id": "m"}]} if self.path == "/v1/models" else {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            text = body["messages"][-1]["content"]
            state["asked"].append(text)
            ids = state["answers"][text]
            message = {"role": "assistant", "content": "x" * len(ids)}
            choice = {"index": 0, "message": message, "finish_reason": "length", "token_ids": ids}
            usage = {"prompt_tokens": 3, "completion_tokens": len(ids), "total_tokens": 3}
            _reply(
                self,
                {"id": "c", "object": "chat.completion", "created": 0, "model": "m"}
                | {"choices": [choice], "usage": usage},
            )

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}", state
    httpd.shutdown()


def test_each_proven_mismatch_is_served_again_and_only_those(chat_stand_in, tmp_path):
    """The evaluation serves the prompts of proven mismatches again (and no other), one at a
    time, and judges each against the target's own output: one that now follows the target
    through its position is transient, one that takes the same token again stays a mismatch."""
    from stages.evaluate import _again
    from stages.evaluate.measures import TRANSIENT, identity_counts
    from tests.conftest import compose

    endpoint, state = chat_stand_in
    cfg = compose([f"hardware.vllm.endpoint={endpoint}"])
    sets = {"mtbench": ["a", "b", "c"], "humaneval": ["d"]}
    target = {"mtbench": {"token_ids": [[1, 2, 3], [4, 5, 6], [7, 8]]}}
    target["humaneval"] = {"token_ids": [[9, 9, 9]]}
    wrong = {"verdict": MISMATCH, "gap": 1.6, "proof": "ranked 2"}
    differs = {
        "mtbench": [
            {**wrong, "position": 1, "draft_token": 7, "target_token": 2},
            None,
            {"verdict": NEAR_TIE, "position": 0, "gap": 0.25, "proof": "gap"},
        ],
        "humaneval": [{**wrong, "position": 2, "draft_token": 4, "target_token": 9}],
    }
    state["answers"] = {"a": [1, 2, 3], "d": [9, 9, 4]}
    got = _again(cfg, SimpleNamespace(path="m"), tmp_path, sets, differs, target, tmp_path)
    assert sorted(state["asked"]) == ["a", "d"]  # the mismatches' prompts only
    assert got["mtbench"][0]["verdict"] == TRANSIENT
    assert got["humaneval"][0]["verdict"] == MISMATCH and got["humaneval"][0]["reproduced"]
    assert got["mtbench"][1] is None and got["mtbench"][2]["verdict"] == NEAR_TIE
    assert differs["mtbench"][0]["verdict"] == MISMATCH  # the first verdicts are kept as given
    counts = identity_counts(got)
    assert (counts["mismatches"], counts["transient_mismatches"], counts["near_ties"]) == (1, 1, 1)
    # Nothing proven: no server is asked.
    state["asked"].clear()
    assert _again(cfg, None, tmp_path, sets, {"mtbench": [None] * 3}, target, tmp_path)
    assert state["asked"] == []


@pytest.fixture
def greedy_stand_in():
    """A completions endpoint that answers prompt logprobs as vLLM does for a target whose
    greedy choice after any prefix is (last token + 1) % 50, its runner-up (last + 2) % 50
    0.3 below and the rest far below; it records each request."""
    asked = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            asked.append(body)
            prompt = body["prompt"]
            rows = [None]
            for prev, tok in itertools.pairwise(prompt):
                ranked = [(prev + 1) % 50, (prev + 2) % 50, (prev + 3) % 50]
                row = {
                    str(t): {"logprob": [-0.1, -0.4, -3.0][r], "rank": r + 1}
                    for r, t in enumerate(ranked[: body["prompt_logprobs"]])
                }
                if str(tok) not in row:  # vLLM lists the prompt's own token with its rank
                    row[str(tok)] = {"logprob": -9.0, "rank": 40}
                rows.append(row)
            _reply(self, {"choices": [{"prompt_logprobs": rows, "text": "x"}]})

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    server = SimpleNamespace(
        url=f"http://127.0.0.1:{httpd.server_port}/v1", model_id="m", check_alive=lambda: None
    )
    yield server, asked
    httpd.shutdown()


def test_the_prefill_identity_check_reads_each_output_once_and_finds_where_it_left(
    greedy_stand_in,
):
    """eval.identity=prefill: one request per served output (prompt and output prefilled
    together, max 1 new token, no cached prefix); an output on the target's greedy path is
    identical, one that took the runner-up is a near tie, one that took a token the target ranks
    40th is a proven mismatch at that position, with the same verdicts the generated check
    gives."""
    from runner.core.schema import typed
    from stages.evaluate.measures import divergence
    from stages.evaluate.serving import read_sets
    from tests.conftest import compose

    server, asked = greedy_stand_in
    cfg = typed(compose([]))
    prompt = [7, 3, 10]
    on_path = [11, 12, 13, 14]
    near = [11, 13, 14, 15]  # the runner-up at position 1, 0.3 below: a near tie
    off = [11, 12, 30, 31]  # 30 at position 2, ranked 40th: a mismatch
    spec = {"mtbench": {"prompt_ids": [prompt] * 3, "token_ids": [on_path, near, off]}}
    got = read_sets(server, spec, cfg)["mtbench"]
    assert len(asked) == 3
    for body, served in zip(asked, [on_path, near, off], strict=True):
        assert body["prompt"] == prompt + served and body["max_tokens"] == 1
        assert body["prompt_logprobs"] >= 2 and body["cache_salt"]
    assert got["token_ids"][0] == on_path  # its own picks along its own path
    verdicts = [
        proven(divergence(s, t, top, cfg.eval.near_tie_gap), got["rescored"].get(i))
        for i, (s, t, top) in enumerate(
            zip([on_path, near, off], got["token_ids"], got["likeliest"], strict=True)
        )
    ]
    assert verdicts[0] is None
    assert verdicts[1]["verdict"] == NEAR_TIE and verdicts[1]["position"] == 1
    assert verdicts[2]["verdict"] == MISMATCH and verdicts[2]["position"] == 2
    assert verdicts[2]["target_token"] == 13 and verdicts[2]["rescored_rank"] == 40
