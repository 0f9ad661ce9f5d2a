"""MLflow: one job's run (`runs`), a sweep's parent run and its comparison (`sweep`), what a run
records for tools outside it (`job_tags`), what a job records beside its stages (`job_record`:
the config, each stage's outputs, the comparison's tags, the registry, a failed run's end), and
the recipes table over seeds (`recipes`).

May import: runner.core, runner.serving (a sweep stops its shared servers), runner.integrations.
"""
