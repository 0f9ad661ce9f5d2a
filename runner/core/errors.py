"""Errors the runner reports to users: each names the config key (or file) to change.

Raise `ConfigError("vocab.draft_vocab_size", "is 60000, above the target's vocab 49152")`;
the entry point prints it without a traceback and exits with status 2.
"""


class ConfigError(Exception):
    """A config value that cannot work; `key` is the dotted config key to change."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}")


class StageError(Exception):
    """A stage that could not produce its artifact, or an upstream artifact that is missing."""
