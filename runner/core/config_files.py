"""The user's own config files, read before Hydra composes them: a YAML mistake is one sentence
with the file, the line and what to change, and a hostile file cannot stall the runner.

    check_config_dirs(sys.argv[1:])  # raises ConfigError(<file>:<line>, why)

Hydra (through OmegaConf and PyYAML) reports a bad indentation, a tab, an unclosed quote, a
duplicate key or a `!!python/...` tag as a traceback, and builds nested YAML aliases ("billion
laughs": nine aliases of nine aliases each) into an exponentially large tree, which ran for
minutes. Here each YAML file of a config directory named on the command line (`-cd`,
`--config-dir`, `-cp`, `--config-path`) that the command composes is first composed into
PyYAML's node graph (linear in the file's size: an alias is a reference there), its expanded
size counted with each shared node counted once per reference, and only then constructed by the
safe loader (a subclass of it), with duplicate keys refused. The project's own conf/ and
sweeps/ are tested and not read again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from runner.core.errors import ConfigError

# Nodes a config may expand to through its aliases: the largest of the project's own files
# has a few hundred; a billion-laughs file of nine levels expands to 9^9.
EXPANDED_NODES_MAX = 100_000
# Files read under one directory (a config directory is a few dozen files).
FILES_MAX = 2_000
_DIR_FLAGS = ("-cd", "--config-dir", "-cp", "--config-path")


def config_dirs(argv: list[str]) -> list[Path]:
    """The config directories the command line names (`-cd X`, `--config-dir=X`, ...)."""
    found = []
    for i, arg in enumerate(argv):
        for flag in _DIR_FLAGS:
            if arg == flag and i + 1 < len(argv):
                found.append(argv[i + 1])
            elif arg.startswith(f"{flag}="):
                found.append(arg.split("=", 1)[1])
    return [Path(d).expanduser() for d in found]


def config_name(argv: list[str]) -> str:
    """The primary config the command line names (`-cn X`, `--config-name X`), else config."""
    for i, arg in enumerate(argv):
        if arg in ("-cn", "--config-name") and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config-name="):
            return arg.split("=", 1)[1]
    return "config"


def check_config_dirs(argv: list[str]) -> None:
    """The files of the named config directories that this command composes: the primary
    config, what its defaults lists name (followed through the files found there), and the
    group options given on the command line (`model=mine`). Other files of the directory are
    Hydra's to read if ever named."""
    folders = [d for d in config_dirs(argv) if d.is_dir()]  # Hydra names a missing one itself
    if not folders:
        return
    wanted = [config_name(argv)]
    for arg in argv:
        group, eq, option = arg.lstrip("+~").partition("=")
        if eq and not arg.startswith("-") and "," not in option and "." not in group:
            wanted.append(f"{group}/{option}")
    seen: set[Path] = set()
    while wanted and len(seen) < FILES_MAX:
        name = wanted.pop(0).removesuffix(".yaml")
        for folder in folders:
            path = folder / f"{name}.yaml"
            if path in seen or not path.is_file():
                continue
            seen.add(path)
            loaded = check_file(path)
            wanted.extend(_defaults_named(loaded, str(Path(name).parent)))


def _defaults_named(loaded: Any, here: str) -> list[str]:
    """Config names a file's defaults list points to ("model: mine" -> model/mine, "base" ->
    base), relative to the file's own group; overrides of Hydra's own groups are not files
    of the directory."""
    entries = loaded.get("defaults") if isinstance(loaded, dict) else None
    names = []
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, str) and entry != "_self_":
            names.append(entry if here in ("", ".") else f"{here}/{entry}")
        elif isinstance(entry, dict):
            for group, option in entry.items():
                group = str(group).removeprefix("override ").strip()
                if isinstance(option, str) and not group.startswith("hydra"):
                    names.append(f"{group.lstrip('/')}/{option}")
    return names


class _NoDuplicates(yaml.SafeLoader):
    """PyYAML's safe loader (no Python tags), refusing a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (give it once)", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def check_file(path: Path) -> Any:
    """The file's contents; raises ConfigError naming `path` and the line for a file Hydra could
    not, or should not, load."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), f"cannot be read as text ({exc})") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise _error(path, exc) from None
    if node is not None:
        size = _expanded(node, {})
        if size > EXPANDED_NODES_MAX:
            raise ConfigError(
                str(path),
                f"its YAML aliases expand to {size:,} nodes or more (at most "
                f"{EXPANDED_NODES_MAX:,}): "
                "write the values out instead of nesting aliases",
            )
    try:
        return yaml.load(text, Loader=_NoDuplicates)
    except yaml.YAMLError as exc:
        raise _error(path, exc) from None


def _expanded(node: yaml.Node, memo: dict[int, int]) -> int:
    """Nodes `node` stands for once every alias is written out (memoised per shared node, so
    the count costs one pass over the graph however large the expansion)."""
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = 1  # a node that contains itself (a recursive alias) counts once
    total = 1
    if isinstance(node, yaml.SequenceNode):
        total += sum(_expanded(child, memo) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        total += sum(_expanded(k, memo) + _expanded(v, memo) for k, v in node.value)
    total = min(total, EXPANDED_NODES_MAX * 10)  # enough to refuse; no huge integers
    memo[id(node)] = total
    return total


def _error(path: Path, exc: yaml.YAMLError) -> ConfigError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    said = f"{context}, {problem}" if context and context not in problem else problem
    if "tab" in said.lower() or "'\\t'" in said:
        said += " (YAML indents with spaces, never tabs)"
    if "could not determine a constructor" in said:
        said += " (config files hold plain values: no Python objects)"
    return ConfigError(where, f"not valid YAML: {said}; fix the file")
