"""The base every other room builds on: the typed config and its checks (`schema`), the errors
the runner raises (`errors`), the one layer-id convention (`layer_ids`), the run's folders
(`layout`) and content-keyed artifact store (`store`), signal handling (`interrupts`), a small
JSON cache, the intervals (`intervals`) and sources shipped as Python packages (`packages`).

May import: nothing of the project outside runner.core. Everything may import it.
"""
