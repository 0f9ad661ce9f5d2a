"""speculators' training settings, as the runner checks and records them (checked against
speculators 0.9.0): its `TrainConfig` resolved from {field: value} through its pure
`TrainConfig.from_sources` (the plan refuses, naming the field, what speculators would refuse
after a model load), the `speculators train` command line they amount to, the settings an
earlier artifact recorded, and the mask token speculators would choose.

Private APIs touched: `speculators.train.config.resolution.CONFIG_DESTS` / `_BACKEND_DESTS`
(its setting names, to refuse one it does not know: `from_sources` ignores it),
`speculators.train.config.resolution.ConfigError`, `build_parser` (`recorded_settings`), and
`speculators.train.utils.load_processor` (`mask_token_id`, swapped for the call); through
`speculators_slots` (imported by `register_slot_backend`): hs-connectors' `FileBackend`,
`FileTransfer.get_cached` and `HiddenStatesBackend.registry`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from runner.integrations import SLOT_BACKEND, SLOTS_ENV
from runner.integrations.versions import lib_version


def register_slot_backend() -> None:
    """Register the "runner-slots" hidden-states backend (runner/integrations/
    speculators_slots.py), which returns only the slots listed in EAGLE3_RUNNER_SLOTS."""
    import runner.integrations.speculators_slots  # noqa: F401  (registers on import; imports torch)


class Refused(Exception):
    """speculators refuses a setting: `dest` is its field (e.g. "checkpoint_freq")."""

    def __init__(self, dest: str | None, message: str):
        super().__init__(message)
        self.dest, self.message = dest, message


def _dests() -> tuple[frozenset[str], frozenset[str]]:
    """speculators' own setting names: (its TrainConfig's fields, its hidden-state backends')."""
    from speculators.train.config import resolution  # imports torch: seconds

    return frozenset(resolution.CONFIG_DESTS), frozenset(resolution._BACKEND_DESTS)


def resolve_train_config(settings: Mapping[str, Any], slots: tuple[int, ...] = ()) -> Any:
    """speculators' TrainConfig for `settings` ({field: value}, as `speculators train` would
    set them from its flags), through its pure `TrainConfig.from_sources`; registers the slot
    backend when it is named. Raises `Refused` naming the first field speculators refuses."""
    from pydantic import ValidationError
    from speculators.train.config import TrainConfig
    from speculators.train.config.resolution import ConfigError as SpeculatorsConfigError

    config_dests, backend_dests = _dests()
    unknown = [k for k in settings if k not in config_dests | backend_dests]
    if unknown:
        raise Refused(
            unknown[0],
            f"speculators {lib_version('speculators')} has no setting "
            f"{unknown[0]!r} (flag --{unknown[0].replace('_', '-')})",
        )
    if settings.get("hidden_states_backend") == SLOT_BACKEND:
        register_slot_backend()
        os.environ[SLOTS_ENV] = ",".join(str(i) for i in slots)
    cli = {k: v for k, v in settings.items() if k in config_dests}
    backend = {k: v for k, v in settings.items() if k in backend_dests}
    try:
        return TrainConfig.from_sources(cli=cli, argv=command_line(settings), backend_cli=backend)
    except ValidationError as exc:
        first = exc.errors()[0]
        dest = str(first["loc"][-1]) if first["loc"] else None
        where = ".".join(str(x) for x in first["loc"])
        raise Refused(dest, f"{where}: {first['msg'].removeprefix('Value error, ')}") from None
    except SpeculatorsConfigError as exc:  # a missing value or a draft-init conflict: its flag
        flag = re.search(r"--([a-z0-9-]+)", str(exc))
        raise Refused(flag.group(1).replace("-", "_") if flag else None, str(exc)) from None


def recorded_settings(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a train artifact was trained with: its manifest's `speculators_settings`,
    or, for one trained before they were recorded, its `speculators_argv` read by speculators'
    own parser (the same stage key: such artifacts are reused)."""
    if "speculators_settings" in manifest:
        return dict(manifest["speculators_settings"])
    from speculators.train.config.resolution import build_parser

    parsed = vars(build_parser().parse_args(list(manifest["speculators_argv"])))
    config_dests, backend_dests = _dests()
    return {k: v for k, v in parsed.items() if k in config_dests | backend_dests}


def command_line(settings: Mapping[str, Any]) -> list[str]:
    """The `speculators train` command these settings amount to (recorded for provenance)."""
    argv = ["speculators", "train"]
    for k, v in settings.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            argv.append(flag)
        elif v is False:
            argv.append(f"--no-{flag[2:]}")
        elif isinstance(v, (list, tuple)):
            argv += [flag, *(str(x) for x in v)]
        else:
            argv += [flag, str(v)]
    return argv


def mask_token_id(path: str, vocab_size: int, trust_remote_code: bool) -> int:
    """speculators' own `resolve_mask_token_id` (the value `--mask-token-id` defaults to), reading
    the tokenizer alone. Without the flag speculators loads the target's AutoProcessor for it,
    which for a multimodal target (Kimi-K2.5) loads the image processor as well: transformers'
    needs torchvision, the real model's is remote code; the mask token is the tokenizer's either
    way. Private API touched: `speculators.train.utils.load_processor` (swapped for the call)."""
    import speculators.train.utils as su
    from transformers import AutoTokenizer

    def tokenizer_only(target: str, *, trust_remote_code: bool = False) -> Any:
        tok = AutoTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code)
        if tok.pad_token is None:  # as speculators' load_processor does
            tok.pad_token = tok.eos_token
        return tok

    original = su.load_processor
    su.load_processor = tokenizer_only
    try:
        found = su.resolve_mask_token_id(
            path, vocab_size, None, trust_remote_code=trust_remote_code
        )
        return int(found)
    finally:
        su.load_processor = original
