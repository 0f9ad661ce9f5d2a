"""One source of truth for the serving settings: the flags in `hardware.vllm.extra_args` (and
the environment variable older vLLMs read) that set what the typed keys set, folded into those
keys before anything checks or keys them.

    fold(cfg.hardware.vllm, cfg.hardware.env)   # in place; ConfigError on a conflict

Why: the plan refuses, for example, FLASHINFER_MLA with an fp8 KV cache on an RTX PRO 6000
(zero acceptance, no error). Given as `extra_args=[--attention-backend,FLASHINFER_MLA]`, the
same server was planned without a word, and a stored evaluation was reused for it, because
the checks and the stage keys read the typed keys only. After `fold`, a setting is in one place
whichever way it was written, and the server gets it once.

Forms read, as vLLM's parser takes them: `--flag value`, `--flag=value`, underscores for
dashes, `--compilation-config`/`-cc` with JSON or a dotted key (`-cc.cudagraph_mode=FULL`),
and the fields of a `--speculative-config` JSON that name the draft's kernel and rejection
sampling (that JSON stays in extra_args: it overrides the runner's own, as vLLM reads it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from runner.core.errors import ConfigError

# vLLM flag (dashes) -> hardware.vllm key.
_FLAGS = {"attention-backend": "attention_backend", "kv-cache-dtype": "kv_cache_dtype"}
_COMPILATION = ("compilation-config", "cc")
# Speculative-config field -> hardware.vllm key.
_SPEC_FIELDS = {
    "attention_backend": "draft_attention_backend",
    "rejection_sample_method": "rejection_sample_method",
}
# The variable vLLM before --attention-backend read for the target's kernel.
ENV_BACKEND = "VLLM_ATTENTION_BACKEND"


def _name(arg: str) -> tuple[str, str | None]:
    """'--kv_cache_dtype=fp8' -> ('kv-cache-dtype', 'fp8'); '-cc.cudagraph_mode' ->
    ('cc.cudagraph-mode', None)."""
    body, eq, value = arg.partition("=")
    return body.lstrip("-").replace("_", "-"), value if eq else None


def _set(v: Any, key: str, value: str, where: str) -> None:
    have = getattr(v, key)
    if have is not None and str(have) != str(value):
        raise ConfigError(
            f"hardware.vllm.{key}",
            f"is {have}, but {where} sets {value}; set it in one place (hardware.vllm.{key})",
        )
    setattr(v, key, str(value))


def _json(text: str, flag: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError:
        raise ConfigError(
            "hardware.vllm.extra_args", f"{flag} takes JSON, and {text!r} is not JSON"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError("hardware.vllm.extra_args", f"{flag} takes a JSON object, not {text!r}")
    return data


def fold(v: Any, env: Mapping[str, str] | None = None) -> None:
    """Move the serving settings written as flags in `v.extra_args` into `v`'s typed keys (in
    place), and read VLLM_ATTENTION_BACKEND from `v.env` or `env` (hardware.env) into
    `attention_backend`. A setting written twice with two values is a ConfigError naming both;
    a flag with no value is one naming extra_args."""
    args = [str(a) for a in v.extra_args]
    kept: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name, value = _name(arg) if arg.startswith("-") else ("", None)
        base, _, dotted = name.partition(".")
        known = name in _FLAGS or base in _COMPILATION or name == "speculative-config"
        if not known:
            kept.append(arg)
            i += 1
            continue
        start = i
        if value is None:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigError("hardware.vllm.extra_args", f"{arg} is given no value")
            value, i = args[i + 1], i + 2
        else:
            i += 1
        given = args[start:i]
        where = f"hardware.vllm.extra_args ({arg.split('=')[0]})"
        if name in _FLAGS:
            _set(v, _FLAGS[name], value, where)
        elif base in _COMPILATION and dotted:
            if dotted == "cudagraph-mode":
                _set(v, "cudagraph_mode", value, where)
            else:
                kept += given
        elif base in _COMPILATION:
            data = _json(value, arg)
            if "cudagraph_mode" in data:
                _set(v, "cudagraph_mode", str(data.pop("cudagraph_mode")), where)
            if data:  # the rest of the compilation config travels as given, with the mode
                mode = {"cudagraph_mode": v.cudagraph_mode} if v.cudagraph_mode else {}
                kept += ["--compilation-config", json.dumps({**data, **mode})]
        else:  # --speculative-config: read, and left where vLLM reads it
            data = _json(value, arg)
            for field, key in _SPEC_FIELDS.items():
                if data.get(field) is not None:
                    _set(v, key, str(data[field]), where)
            kept += given
    v.extra_args = kept
    for source, variables in (("hardware.vllm.env", v.env), ("hardware.env", env or {})):
        if variables.get(ENV_BACKEND):
            _set(v, "attention_backend", str(variables[ENV_BACKEND]), f"{source}.{ENV_BACKEND}")


def carries_compilation_config(extra_args: list[str]) -> bool:
    """Whether extra_args keeps a --compilation-config of its own (its other keys), which then
    carries the CUDA graph mode too: the runner does not write a second one."""
    return "--compilation-config" in [str(a) for a in extra_args]
