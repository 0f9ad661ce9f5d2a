"""The companion commands of `eagle3-runner`: the dispatcher and `--version` (`cli`), config
discovery (`ls`), a preset or sweep copied to edit (`cp`), `publish`, `report` and `gc`, and the
store options publish and report share (`store_options`).
(`transfer` is runner.assets.transfer.)

May import: every room of runner/. Nothing imports it but the composition root.
"""
