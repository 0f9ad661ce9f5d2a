"""The engine: the stage contract (`stage`), the plan as a value and its execution (`pipeline`),
one job from config to summary (`job`), the plan's engine, hardware and tracking lines
(`preflight`), the checks against the target's facts (`checks`), cost estimates (`costs`) and
the console (`console`).

It runs whatever stages it is handed and names none (tests/test_import_graph.py).
May import: every room of runner/ but runner.commands; never stages/.
"""
