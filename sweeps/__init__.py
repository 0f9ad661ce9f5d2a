"""sweeps/ as the `runner.sweeps` package of the wheel, on Hydra's search path through
hydra_plugins/eagle3_runner_sweeps (`pkg://runner.sweeps`). No code."""
