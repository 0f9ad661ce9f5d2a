"""Checks of the environment a run sets for itself and its children (`hardware.env`,
`hardware.vllm.env`): the values of variables whose type is known (NCCL's, CUDA's), and the
loader variables that would change which code every child runs.

A wrong NCCL value is not refused by NCCL itself: it warns in a log nobody reads, or hangs after
init, thirty minutes into a model load. Here it is one line in the plan, naming the key.
"""

from __future__ import annotations

import re

from runner.core.errors import ConfigError

# Variables that decide which programs, shared objects or Python modules every child loads or
# runs: refused unless hardware.allow_loader_env (a debugging preload, a custom NCCL build) says
# so. Whole families: the dynamic loader's (LD_*: LD_PRELOAD, LD_AUDIT, ...), Python's
# (PYTHON*: PYTHONPATH, PYTHONSTARTUP, PYTHONWARNINGS imports the categories it names, ...),
# the shells' start-up files, the search path for programs and glibc's converter modules.
LOADER_PREFIXES = ("LD_", "PYTHON", "DYLD_")
LOADER_NAMES = frozenset({"BASH_ENV", "ENV", "PATH", "GCONV_PATH", "LOCPATH", "NLSPATH"})
# Python variables that change no code: buffering, hashing, bytecode files, fault handler, I/O.
HARMLESS = frozenset(
    {
        "PYTHONUNBUFFERED",
        "PYTHONHASHSEED",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONFAULTHANDLER",
        "PYTHONIOENCODING",
        "PYTHONUTF8",
    }
)


def is_loader_variable(name: str) -> bool:
    """Whether setting `name` changes which code a child process loads or runs."""
    if name in HARMLESS:
        return False
    return name in LOADER_NAMES or name.startswith(LOADER_PREFIXES)


_BOOL = ("0", "1")
_P2P_LEVELS = ("LOC", "NVL", "PIX", "PXB", "PHB", "SYS")
_PROTOCOLS = ("LL", "LL128", "SIMPLE")
_ALGORITHMS = ("RING", "TREE", "COLLNETDIRECT", "COLLNETCHAIN", "NVLS", "NVLSTREE", "PAT")
_DEBUG = ("VERSION", "WARN", "INFO", "TRACE")


def _flag(value: str) -> str | None:
    return None if value in _BOOL else "0 or 1"


def _count(value: str) -> str | None:
    return None if value.isdigit() else "a whole number"


def _p2p_level(value: str) -> str | None:
    return None if value.upper() in _P2P_LEVELS or value.isdigit() else " or ".join(_P2P_LEVELS)


def _list_of(names: tuple[str, ...]) -> object:
    """NCCL's list syntax: names separated by commas, the whole optionally negated with ^."""

    def check(value: str) -> str | None:
        items = value.removeprefix("^").split(",")
        ok = all(i.strip().upper() in names for i in items if i.strip()) and value.strip("^, ")
        return None if ok else f"a comma-separated list of {', '.join(names)} (^ to exclude)"

    return check


def _debug(value: str) -> str | None:
    return None if value.upper() in _DEBUG else " or ".join(_DEBUG)


def _devices(value: str) -> str | None:
    ok = all(re.fullmatch(r"\d+|(GPU|MIG)-[0-9A-Za-z/-]+", d.strip()) for d in value.split(","))
    return None if ok and value.strip() else "device indices or UUIDs, comma-separated (0,1,2)"


# What each known variable takes.
KNOWN = {
    "NCCL_IB_DISABLE": _flag,
    "NCCL_P2P_DISABLE": _flag,
    "NCCL_SHM_DISABLE": _flag,
    "NCCL_NVLS_ENABLE": _flag,
    "NCCL_CUMEM_ENABLE": _flag,
    "NCCL_P2P_LEVEL": _p2p_level,
    "NCCL_MIN_NCHANNELS": _count,
    "NCCL_MAX_NCHANNELS": _count,
    "NCCL_BUFFSIZE": _count,
    "NCCL_NTHREADS": _count,
    "NCCL_PROTO": _list_of(_PROTOCOLS),
    "NCCL_ALGO": _list_of(_ALGORITHMS),
    "NCCL_DEBUG": _debug,
    "CUDA_VISIBLE_DEVICES": _devices,
    "OMP_NUM_THREADS": _count,
}


def check_env(key: str, env: dict[str, str], allow_loader: bool) -> None:
    """Refuses, naming `key.VARIABLE`, a variable name that cannot be set, a loader variable
    (unless allowed) or a value its variable does not take."""
    for name, value in env.items():
        where = f"{key}.{name}"
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ConfigError(where, "is not an environment variable name")
        if is_loader_variable(name) and not allow_loader:
            raise ConfigError(
                where,
                "changes which libraries or modules every child process loads (vLLM, the "
                "training ranks); set hardware.allow_loader_env=true if that is what you want",
            )
        check = KNOWN.get(name)
        problem = check(str(value)) if check else None
        if problem:
            raise ConfigError(where, f"{value!r} is not what {name} takes: {problem}")


# Variables that say how much to log or where to run, never what is computed: left out of stage
# keys, so that turning on NCCL's debug log or moving vLLM's CPU threads reuses what is stored.
# Every other variable a stage's processes get is part of its key (an NCCL algorithm sums in
# another order; a vLLM variable can pick another kernel).
NOT_IN_KEY_PREFIXES = ("NCCL_DEBUG", "VLLM_CPU_", "TORCH_SHOW_", "TQDM_", "HF_HUB_")
NOT_IN_KEY = frozenset(
    {
        "VLLM_LOGGING_LEVEL",
        "VLLM_CONFIGURE_LOGGING",
        "VLLM_LOG_STATS_INTERVAL",
        # Whether vLLM's engine runs in a process of its own: where, not what, it computes.
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "TRANSFORMERS_VERBOSITY",
        "TOKENIZERS_PARALLELISM",
        "CUDA_VISIBLE_DEVICES",
        "OMP_NUM_THREADS",
        "MLFLOW_TRACKING_URI",
        *HARMLESS,
    }
)


def keyed(*envs: dict[str, str]) -> dict[str, str]:
    """The variables of `envs` (later ones win) that can change what a stage computes, sorted:
    what a stage's key records of the environment its processes get."""
    merged: dict[str, str] = {}
    for env in envs:
        merged.update({str(k): str(v) for k, v in env.items()})
    return {
        k: merged[k]
        for k in sorted(merged)
        if k not in NOT_IN_KEY and not k.startswith(NOT_IN_KEY_PREFIXES)
    }
