"""conf/ as the `runner.conf` package of the wheel: Hydra reads an installed primary config
through package resources (`pkg://runner.conf`), which needs this file. No code."""
