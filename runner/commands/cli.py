"""The `eagle3-runner` command family: one entry point for the runner and its companion tools.

    eagle3-runner [group=option ...] [key=value ...]   the pipeline (Hydra; `-m` for a sweep)
    eagle3-runner ls [GROUP | KEY] [overrides]          config groups, sweeps, one key's help
    eagle3-runner cp GROUP/OPTION FILE                  a preset or sweep as a file to edit
    eagle3-runner publish OUT [--run ID]                a trained draft as a hub folder with a card
    eagle3-runner transfer pack|unpack SRC OUT --target T
    eagle3-runner report [RUN_ID]                       a run's or a sweep's table
    eagle3-runner gc [--delete]                         what the store can give back
    eagle3-runner ui [--port P]                         MLflow's UI on the store, on the results
    eagle3-runner --version                             the runner's and its engines' versions

`python -m runner ...` is the same command; `python -m runner.commands.publish` and the other
modules
still work on their own. Every companion takes the same names for the same things:
`--output-root` (run.output_root), `--tracking-uri`, `--experiment`, `--run`.
This module imports nothing heavy: `--version` and `ls` answer in about a second.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

# Subcommand -> the module whose `main(argv) -> int` runs it.
SUBCOMMANDS = {
    "ls": "runner.commands.ls",
    "cp": "runner.commands.cp",
    "publish": "runner.commands.publish",
    "transfer": "runner.assets.transfer",
    "report": "runner.commands.report",
    "gc": "runner.commands.gc",
    "ui": "runner.tracking.ui",
}
# Libraries whose versions decide what a run produces, as `--version` lists them.
ENGINES = ("vllm", "speculators", "torch", "transformers", "hydra-core", "mlflow")


def version_text() -> str:
    from runner.integrations.versions import TRACKED, lib_version

    lines = [f"eagle3-runner {lib_version('eagle3-runner')}"]
    for label in ENGINES:
        lines.append(f"  {label:<13} {lib_version(*TRACKED.get(label, (label,)))}")
    return "\n".join(lines)


def _complete_subcommands() -> None:
    """Bash completion (Hydra's, `eval "$(eagle3-runner -sc install=bash)"`) with the
    subcommands added: they are offered for the first word, and after one Hydra's overrides
    would be wrong, so nothing is."""
    import os

    line = os.environ.get("COMP_LINE", "")
    words = line.split()
    typing_first = len(words) == 1 or (len(words) == 2 and not line.endswith(" "))
    if typing_first:
        prefix = words[1] if len(words) == 2 else ""
        print(" ".join(s for s in SUBCOMMANDS if s.startswith(prefix)), end=" ")
    elif len(words) >= 2 and words[1] in SUBCOMMANDS:
        sys.exit(0)


def dispatch(pipeline: Callable[[], None], argv: list[str] | None = None) -> None:
    """Run a subcommand or `--version`; anything else goes to `pipeline` (the Hydra app, which
    reads sys.argv itself)."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] in (["--version"], ["-V"]):
        print(version_text())
        sys.exit(0)
    if args[:1] in (["-sc"], ["--shell-completion"]) and args[1:2] == ["query=bash"]:
        _complete_subcommands()
    if args and args[0] in SUBCOMMANDS:
        module = importlib.import_module(SUBCOMMANDS[args[0]])
        try:
            sys.exit(module.main(args[1:]))
        except BrokenPipeError:  # `eagle3-runner ls | head`: the reader left, nothing is wrong
            sys.stderr.close()
            sys.exit(0)
    pipeline()
