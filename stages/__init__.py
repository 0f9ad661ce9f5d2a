"""The pipeline's stages, one module each, and their registry: the one list of stages.

Each module exports `STAGE`, a `runner.engine.stage.Stage` declaring its name, upstream stages,
version, key, run function, MLflow outputs, summary lines, sweep columns and plan lines. To add a
stage, write its module and add it to `REGISTRY` below, after the stages it reads.
"""

from runner.engine.stage import Stage
from stages import evaluate, extract, prepare, regenerate, train, vocab

REGISTRY: tuple[Stage, ...] = (
    regenerate.STAGE,  # optional: on when a regenerate backend is selected
    prepare.STAGE,
    extract.STAGE,
    vocab.STAGE,
    train.STAGE,
    evaluate.STAGE,
)
