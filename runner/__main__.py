"""Entry point: `python -m runner [group=option ...] [key=value ...]`, or `-m` for a Hydra multirun.

Composes conf/ (see conf/config.yaml), checks the config, materialises the target, plans the
stages against the artifact store, runs or reuses each one inside one MLflow run, and prints a
summary with the `mlflow ui` command that shows the run. Examples:
    python -m runner                                   # embedded default, CPU, no network
    python -m runner train.draft_vocab_size=16384      # re-runs vocab, train, evaluate only
    python -m runner run.stages=[prepare,extract]      # e.g. on the GPU box
    python -m runner --cfg job                         # print the composed config
"""

from __future__ import annotations

import os
import sys
import traceback

import hydra
from hydra.core.config_store import ConfigStore

from runner.errors import ConfigError, StageError
from runner.schema import RunnerConfig

ConfigStore.instance().store(name="base_config", node=RunnerConfig)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg) -> float | None:
    from runner.job import run_job

    multirun = _is_multirun()
    try:
        result = run_job(cfg)
    except ConfigError as exc:
        print(f"\nconfig error: {exc.key}: {exc.message}\n(change `{exc.key}` in conf/ or on the command line)",
              file=sys.stderr)
        if multirun:  # the job's run is FAILED; the sweep goes on and its parent still closes
            return None
        sys.exit(2)
    except StageError as exc:
        print(f"\nstage error: {exc}", file=sys.stderr)
        if multirun:
            return None
        sys.exit(1)
    except Exception:
        if multirun:
            traceback.print_exc()
            return None
        raise
    if cfg.run.plan_only and not multirun:
        # Nothing is left to write; skip the interpreter's teardown of torch and transformers
        # (about a second of a plan that should take a few).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    # Returned so that sweepers can optimise it.
    return result.get("acceptance_length")


def _is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


if __name__ == "__main__":
    main()
    from runner.sweep import FAILED_JOBS

    if FAILED_JOBS:
        print(f"{len(FAILED_JOBS)} sweep job(s) failed: {FAILED_JOBS}", file=sys.stderr)
        sys.exit(1)
