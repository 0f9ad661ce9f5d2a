"""How the plan judges a vLLM server that already runs (hardware.vllm.endpoint) from what its API
says: which setting each difference is blamed on. The same checks against a real vLLM server
run in the vllm lane (tests/test_vllm_backend.py)."""

from __future__ import annotations

from runner.serving.endpoint import DRAFT, EXTRACTION, EndpointInfo, problems

TOKENS = [504, 2365, 6354, 28]


def info(**kw) -> EndpointInfo:
    base = dict(
        url="http://box-a:8000", model_root="/models/kimi", max_model_len=4097, tokens=TOKENS
    )
    return EndpointInfo(**{**base, **kw})


def engine(method: str, k: int = 1, dtype: str = "torch.bfloat16") -> dict:
    kv = {"kv_connector": "ExampleHiddenStatesConnector"} if method == EXTRACTION else None
    return {
        "speculative_config": {"method": method, "num_speculative_tokens": k},
        "kv_transfer_config": kv,
        "model_config": {"dtype": dtype},
    }


def keys(found) -> list[tuple[str, str]]:
    return [(level, key) for level, key, _ in found]


def check(i: EndpointInfo, need: str, **kw):
    args = dict(
        tokens=TOKENS,
        min_model_len=4097,
        len_key="data.max_seq_len",
        dtype="bfloat16",
        k=None,
        k_key="eval.num_speculative_tokens",  # the key the draft's stage names (ServerNeed)
    )
    return problems(i, need, **{**args, **kw})


def test_a_matching_extraction_server_passes():
    assert check(info(config=engine(EXTRACTION)), EXTRACTION) == []


def test_each_difference_names_its_setting():
    assert keys(check(info(tokens=[1, 2, 3]), EXTRACTION))[0] == ("error", "model")
    short = check(info(max_model_len=2048, config=engine(EXTRACTION)), EXTRACTION)
    assert keys(short) == [("error", "data.max_seq_len")] and "--max-model-len 4097" in short[0][2]
    wrong = check(info(config=engine(DRAFT, k=3)), EXTRACTION)
    assert keys(wrong) == [("error", "hardware.vllm.endpoint")] and "'eagle3'" in wrong[0][2]
    no_kv = engine(EXTRACTION) | {"kv_transfer_config": None}
    assert keys(check(info(config=no_kv), EXTRACTION)) == [("error", "hardware.vllm.endpoint")]
    half = check(info(config=engine(EXTRACTION, dtype="torch.float16")), EXTRACTION)
    assert keys(half) == [("error", "hardware.dtype")]
    k = check(info(config=engine(DRAFT, k=5)), DRAFT, k=3, len_key="eval.max_model_len")
    assert keys(k) == [("error", "eval.num_speculative_tokens")]


def test_a_server_hiding_its_config_is_judged_by_its_metrics():
    # No /server_info: a draft server shows its k in the per-position counters.
    assert keys(check(info(spec_positions=3), DRAFT, k=3)) == [
        ("warning", "hardware.vllm.endpoint")
    ]
    assert ("error", "eval.num_speculative_tokens") in keys(
        check(info(spec_positions=5), DRAFT, k=3)
    )
    assert ("error", "hardware.vllm.endpoint") in keys(check(info(), DRAFT, k=3))


def _serve(models_answer: str):
    """A local HTTP server that answers /health and /v1/models with `models_answer`."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = (models_answer if self.path.startswith("/v1/models") else "{}").encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


import pytest  # noqa: E402


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        ("[1, 2]", "other than OpenAI's model list"),
        ('{"data": "x"}', "other than OpenAI's model list"),
        ('{"data": [{"id": "m", "max_model_len": "4096"}]}', "max_model_len '4096'"),
        ('{"data": []}', "serves no model"),
    ],
)
def test_a_server_answering_in_an_unexpected_shape_is_described_not_a_traceback(answer, words):
    from runner.serving.endpoint import inspect

    server = _serve(answer)
    try:
        found = inspect(f"http://127.0.0.1:{server.server_port}", timeout=5)
    finally:
        server.shutdown()
    assert isinstance(found, str) and words in found, found
