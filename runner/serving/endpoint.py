"""Checks that a vLLM server the runner did not start (`hardware.vllm.endpoint`) is the one a
stage needs, through its HTTP API, before any stage runs.

Used by the plan (runner/engine/preflight.py): `inspect(url)` reads what the server tells about
itself,
`problems(info, ...)` compares it with the composed config and names the setting that differs.

What vLLM's API shows, and so what is checked:
- /health, /version, /v1/models: that it answers, its version, the served model and its
  max_model_len (>= data.max_seq_len + 1 to extract, >= eval.max_model_len to evaluate);
- /tokenize: a fixed text tokenized by the server and by the configured target's tokenizer must
  give the same ids (the same model family and tokenizer, whatever the paths on each box);
- /server_info, only when the server runs with VLLM_SERVER_DEV_MODE=1: the speculative method
  (extract_hidden_states to extract or train online, eagle3 to evaluate), the hidden-states
  connector, the dtype and the number of draft tokens. vLLM does not report the capture layer
  ids there; the stages check the slot count of the first sample the server writes instead;
- /metrics: the per-position acceptance counters a draft-serving server exposes give its k
  (eval.num_speculative_tokens) even without /server_info.
"""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# Tokenized by both sides: words, digits, punctuation and a non-ASCII character, so that two
# different tokenizers almost surely disagree somewhere.
PROBE_TEXT = "The quick brown fox, 42 times: déjà vu!\nprint('x')"
# What each kind of stage needs the server to run.
EXTRACTION = "extract_hidden_states"
DRAFT = "eagle3"


@dataclass
class EndpointInfo:
    url: str
    version: str = "unknown"
    model_id: str = ""
    model_root: str = ""
    max_model_len: int | None = None
    # The engine config from /server_info (None when the server hides it).
    config: dict[str, Any] | None = None
    # Draft positions counted in /metrics (0: the server speculates with no draft).
    spec_positions: int = 0
    tokens: list[int] | None = None
    notes: list[str] = field(default_factory=list)


def _get(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _post(url: str, body: dict[str, Any], timeout: float) -> str:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def inspect(endpoint: str, timeout: float = 10.0) -> EndpointInfo | str:
    """What the server says about itself, or why it could not be asked."""
    base = endpoint.rstrip("/")
    try:
        _get(base + "/health", timeout)
        answer = json.loads(_get(base + "/v1/models", timeout))
    except (urllib.error.URLError, OSError, ValueError, RecursionError) as exc:
        return f"does not answer ({getattr(exc, 'reason', exc)})"
    models = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        return "answers /v1/models with something other than OpenAI's model list: not vLLM?"
    if not models:
        return "answers but serves no model"
    first = models[0]
    length = first.get("max_model_len")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int)):
        return f"answers /v1/models with max_model_len {length!r}, not a number: not vLLM?"
    info = EndpointInfo(
        url=base,
        model_id=str(first.get("id", "")),
        model_root=str(first.get("root") or first.get("id", "")),
        max_model_len=length,
    )
    with contextlib.suppress(urllib.error.URLError, OSError, ValueError, AttributeError):
        info.version = str(json.loads(_get(base + "/version", timeout)).get("version", "unknown"))
    try:
        body = {"model": info.model_id, "prompt": PROBE_TEXT, "add_special_tokens": False}
        info.tokens = list(json.loads(_post(base + "/tokenize", body, timeout))["tokens"])
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError):
        info.notes.append("/tokenize did not answer: the tokenizer was not compared")
    try:
        raw = _get(base + "/server_info?config_format=json", timeout)
        config = json.loads(raw).get("vllm_config")
        info.config = config if isinstance(config, dict) else None
    except (urllib.error.URLError, OSError, ValueError, AttributeError):
        pass
    try:
        positions = set()
        for fam in text_string_to_metric_families(_get(base + "/metrics", timeout)):
            for s in fam.samples:
                if s.name.startswith("vllm:spec_decode_num_accepted_tokens_per_pos"):
                    positions.add(s.labels.get("position"))
        info.spec_positions = len(positions)
    except (urllib.error.URLError, OSError, ValueError):
        pass
    return info


def _spec(info: EndpointInfo) -> dict[str, Any]:
    return (info.config or {}).get("speculative_config") or {}


def _wrong_job(info: EndpointInfo, need: str, spec: dict[str, Any]) -> str | None:
    """Why a server is set up for the other job (extraction against a draft), the one thing to
    fix first; None if it is not."""
    if info.config is not None and spec.get("method") != need:
        recipe = (
            "--speculative-config with method extract_hidden_states and the capture ids, and "
            "--kv-transfer-config with a hidden-states connector (docs/multi-box.md: two boxes)"
            if need == EXTRACTION
            else "--speculative-config with method eagle3 and the trained draft"
        )
        return (
            f"runs speculative method {spec.get('method')!r}; this stage needs {need!r}: "
            f"restart it with {recipe}"
        )
    if info.config is None and need == DRAFT and info.spec_positions == 0:
        return (
            "counts no speculative decoding in /metrics: it serves no draft; start it with "
            '--speculative-config \'{"method": "eagle3", "model": <the draft>, '
            '"num_speculative_tokens": k}\''
        )
    return None


def _unchecked(
    info: EndpointInfo, need: str, k: int | None, k_key: str
) -> list[tuple[str, str, str]]:
    """A server that hides its engine config: its draft's positions from /metrics, and a
    warning that the method and dtype go unchecked."""
    out = []
    if need == DRAFT and k is not None and info.spec_positions != k:
        out.append(
            (
                "error",
                k_key,
                f"proposes {info.spec_positions} draft tokens (per-position counters in /metrics)"
                f", this run expects k={k}",
            )
        )
    out.append(
        (
            "warning",
            "hardware.vllm.endpoint",
            "hides its engine config (/server_info answers only with VLLM_SERVER_DEV_MODE=1): "
            "the speculative method and dtype are not checked here"
            + (
                "; the first sample's slot count is checked when it arrives"
                if need == EXTRACTION
                else ""
            ),
        )
    )
    return out


def problems(
    info: EndpointInfo,
    need: str,
    *,
    tokens: list[int] | None,
    min_model_len: int,
    len_key: str,
    dtype: str,
    k: int | None = None,
    k_key: str = "k",
) -> list[tuple[str, str, str]]:
    """(level, key, message) for every way the server differs from what a stage needs.

    need: EXTRACTION (extract, or train online) or DRAFT (evaluate). tokens: the configured
    target's ids for PROBE_TEXT (None: not compared). min_model_len: the longest request the
    stage sends, and len_key the setting that sets it. k: the draft tokens evaluation expects.
    """
    out: list[tuple[str, str, str]] = []
    where = f"the server at {info.url} ({info.model_root}, vLLM {info.version})"

    def err(key: str, msg: str) -> None:
        out.append(("error", key, f"{where} {msg}"))

    if tokens is not None and info.tokens is not None and tokens != info.tokens:
        err(
            "model",
            f"tokenizes a probe text as {info.tokens[:8]}..., the configured target as "
            f"{tokens[:8]}...: it serves another model; point hardware.vllm.endpoint at a server "
            "of this target, or choose the served model with model=...",
        )
    spec = _spec(info)
    wrong = _wrong_job(info, need, spec)
    if wrong:
        err("hardware.vllm.endpoint", wrong)
        return out
    if info.max_model_len is not None and info.max_model_len < min_model_len:
        err(
            len_key,
            f"serves at most {info.max_model_len} tokens per request (--max-model-len); this "
            f"stage sends up to {min_model_len}: lower {len_key} or restart the server with "
            f"--max-model-len {min_model_len}",
        )
    if info.config is None:  # what a server that hides its engine config still shows
        out += [(lvl, key, f"{where} {msg}") for lvl, key, msg in _unchecked(info, need, k, k_key)]
        return out
    if need == EXTRACTION and not (info.config.get("kv_transfer_config") or {}).get("kv_connector"):
        err(
            "hardware.vllm.endpoint",
            "has no --kv-transfer-config: its hidden states are not written anywhere",
        )
    if need == DRAFT and k is not None and spec.get("num_speculative_tokens") != k:
        err(
            k_key,
            f"proposes {spec.get('num_speculative_tokens')} draft tokens; this run expects k={k}",
        )
    served_dtype = str((info.config.get("model_config") or {}).get("dtype", "")).split(".")[-1]
    if served_dtype and served_dtype != dtype:
        err("hardware.dtype", f"runs in {served_dtype}; this run's hardware.dtype is {dtype}")
    return out


def describe(info: EndpointInfo) -> str:
    spec = _spec(info)
    what = spec.get("method") or (
        f"a draft with {info.spec_positions} positions" if info.spec_positions else "no draft"
    )
    config = "" if info.config is not None else ", engine config hidden"
    return (
        f"{info.url}: {info.model_root}, vLLM {info.version}, max_model_len "
        f"{info.max_model_len}, speculative: {what}{config}"
    )
