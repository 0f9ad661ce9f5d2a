"""Entry point: `python -m runner [group=option ...] [key=value ...]` (installed: `eagle3-runner`),
or `-m` for a Hydra multirun; `python -m runner ls|publish|transfer|report|gc|--version` runs a
companion tool (runner/commands/cli.py).

Composes conf/ (see conf/config.yaml), checks the config, materialises the target, plans the
stages against the artifact store, runs or reuses each one inside one MLflow run, and prints a
summary with the `eagle3-runner ui` command that shows the run. The stage registry comes from the
composition root (runner/composition.py), which hands it to the engine; nothing imports this
module. Examples:
    python -m runner                                   # embedded default, CPU, no network
    python -m runner vocab.draft_vocab_size=16384      # re-runs vocab, train, evaluate only
    python -m runner run.stages=[prepare,extract]      # e.g. on the GPU box
    python -m runner --cfg job                         # print the composed config
Exit status: 0 done, 1 a stage failed (or a sweep job did), 2 a config error (including one
Hydra finds while composing: a wrong type or choice, an unknown option), 130 / 143 stopped by
SIGINT / SIGTERM (the MLflow run is KILLED; the same command continues).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from runner.composition import REGISTRY, compose_root
from runner.core.config_files import check_config_dirs
from runner.core.errors import ConfigError, StageError
from runner.core.interrupts import Interrupted, as_interrupted, held_back
from runner.core.schema import did_you_mean, entry_fields, schema_for
from runner.engine.job import rerun_command, run_job, stages_started
from runner.serving.shared_servers import stop_all
from runner.tracking.sweep import SEARCH_ENV, end_interrupted_sweep

# Set once Hydra has composed a config and called `main`: an exit before that is Hydra refusing
# the command line or the composition (a wrong type or choice, an unknown group option).
_composed = False


# conf/ of a source checkout, else the copy the wheel installs as the `runner.conf` package.
_SOURCE_CONF = Path(__file__).resolve().parent.parent / "conf"
# An absolute folder: the console script of an editable install runs from any directory.
CONFIG_PATH = str(_SOURCE_CONF) if (_SOURCE_CONF / "config.yaml").is_file() else "pkg://runner.conf"


@hydra.main(config_path=CONFIG_PATH, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    global _composed
    _composed = True
    compose_root()  # again in a launcher's job process, which did not start at `console`
    # In a multirun a job's failure is a value (its MLflow run is FAILED, nothing is raised),
    # so the sweep goes on and its parent still closes; the sweep then exits 1
    # (runner/tracking/sweep.py).
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        result = run_job(cfg, stages=REGISTRY)
    except ConfigError as exc:
        print(
            f"\nconfig error: {exc.key}: {exc.message}\n"
            f"(change `{exc.key}` in conf/ or on the command line)",
            file=sys.stderr,
        )
        if multirun and os.environ.get(SEARCH_ENV):
            # A search cannot go on without this trial's objective: it ends here, FAILED.
            with held_back():
                end_interrupted_sweep(cfg, status="FAILED")
            _exit_now(2)
        if multirun:
            return None
        _drop_run_dir()
        sys.exit(2)
    except StageError as exc:
        print(f"\nstage error: {exc}", file=sys.stderr)
        if multirun and os.environ.get(SEARCH_ENV):
            # A search cannot go on without this trial's objective: it ends here, FAILED.
            with held_back():
                end_interrupted_sweep(cfg, status="FAILED")
            _exit_now(1)
        if multirun:
            return None
        sys.exit(1)
    except (Interrupted, KeyboardInterrupt) as exc:  # a signal stops a sweep too
        stopped = as_interrupted(exc)
        assert stopped is not None
        where = f" during stage '{stopped.stage}'" if stopped.stage else ""
        detail = stopped.detail or (
            "nothing half-written was published (a resumable stage keeps its work folder); "
            f"run the same command to continue: {rerun_command()}"
        )
        print(f"\ninterrupted by {stopped.name}{where}: {detail}", file=sys.stderr)
        if multirun:
            with held_back():
                end_interrupted_sweep(cfg)
        _exit_now(stopped.exit_code)
    except Exception:
        if multirun:
            traceback.print_exc()
            return None
        raise
    if cfg.run.plan_only and not multirun:
        # Nothing is left to write; skip the interpreter's teardown of torch and transformers
        # (about a second of a plan that should take a few).
        _drop_run_dir()
        _exit_now(0)
    return result.objective  # for sweepers that optimise it


def _drop_run_dir() -> None:
    """A plan alone, or a run refused before any stage, leaves no <output_root>/hydra/<time>/
    folder behind: what it printed is all it has to say (and nothing ran to keep a log of)."""
    if stages_started():  # its log tells what the stages did before the refusal
        return
    folder = Path(HydraConfig.get().runtime.output_dir)
    for handler in list(logging.getLogger().handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).is_relative_to(
            folder
        ):
            handler.close()
            logging.getLogger().removeHandler(handler)
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):  # the hydra/ folder too, if this run made it alone
        folder.parent.rmdir()


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown, once the run is closed: freeing torch,
    transformers and a stage's rows took 2 s of CPU after a SIGTERM in prepare, and 12 s on a
    loaded machine, where a scheduler's grace period before SIGKILL may be shorter. What the
    teardown would have done that matters is done here: the sweep's shared vLLM servers stop
    (their atexit hook) and the log files are flushed."""
    stop_all()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def entry() -> None:
    """`main`, with Hydra's own refusals of the config given the config-error exit status, and
    the user's config files read first (runner/core/config_files.py): a YAML mistake is one
    line with the file and the line, a hostile file is refused at once."""
    try:
        check_config_dirs(sys.argv[1:])
    except ConfigError as exc:
        print(f"config error: {exc.key}: {exc.message}", file=sys.stderr)
        sys.exit(2)
    try:
        main()
    except SystemExit as exc:
        if exc.code == 1 and not _composed:
            print("(a config error: change the key Hydra names above)", file=sys.stderr)
            schema = schema_for(REGISTRY)
            for arg in sys.argv[1:]:
                if "=" in arg and not arg.startswith("-"):
                    near = did_you_mean(arg, schema)
                    if near:
                        print(f"(did you mean {near}?)", file=sys.stderr)
            if any(a.lstrip("+~").startswith("data.sources") for a in sys.argv[1:]):
                # Hydra names a misspelled field of an entry without the list it sits in.
                fields = ", ".join(entry_fields(schema, "data.sources"))
                print(f"(data.sources: each entry takes {fields})", file=sys.stderr)
            sys.exit(2)
        raise


def console() -> None:
    """The `eagle3-runner` command: a subcommand (ls, publish, transfer, report, gc) or
    `--version` (runner/commands/cli.py), else the pipeline."""
    from runner.commands.cli import dispatch

    compose_root()
    try:
        dispatch(entry)
    except BrokenPipeError:
        # The reader left (`eagle3-runner --help | head`): what it read is what it wanted. The
        # output still buffered goes nowhere, not into a traceback at exit (Python's own advice).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)


if __name__ == "__main__":
    console()
