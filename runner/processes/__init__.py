"""Child processes the runner starts: a managed child with its log and stop (`process`), the
reaper that ends a child's tree when the runner dies (`reaper`), torchrun's ranks (`launch`).

May import: runner.core.
"""
