"""What there is to choose, without reading conf/: `eagle3-runner ls`.

    eagle3-runner ls                 every config group with its options (* = the default) and
                                     the shipped sweeps, each with the first sentence of its file
    eagle3-runner ls model           one group: each option with its whole header comment
    eagle3-runner ls train.lr        one key: its type, its value in the composed config, the
                                     file that sets it and the schema's comment
    eagle3-runner ls train.lr hardware=gpu1   ... with overrides applied, as a run would get it

Reads the config folders the runner composes from (a source checkout's conf/ and sweeps/, else
the copies a wheel installs) and the typed schema (runner/core/schema.py and each stage's
settings); loads no model.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import textwrap
import typing
from importlib import resources
from pathlib import Path
from typing import Any

from runner import SOURCE_ROOT

_REPO = SOURCE_ROOT


def config_folder(name: str) -> Path:
    """conf/ or sweeps/ of a source checkout, else the package the wheel installs them as."""
    source = _REPO / name
    if source.is_dir():
        return source
    return Path(str(resources.files(f"runner.{name}")))


def header(path: Path) -> str:
    """The comment block a config file starts with, as one paragraph."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if not re.match(r"#\s*@", line):  # Hydra's directives (# @package), not prose
            lines.append(line.lstrip("#").strip())
    return " ".join(x for x in lines if x)


def first_sentence(text: str, width: int = 88) -> str:
    """The header's first sentence, without its "Target:"-style label, cut to `width`."""
    text = re.sub(
        r"^(Target|Data|Hardware|Train|Vocab|Evaluate|Extract|Regenerate|Tracking|"
        r"Launcher|Sweep|Preset)[^:]*:\s*",
        "",
        text,
    )
    if not text.startswith("speculators"):  # a name keeps its own case
        text = text[:1].upper() + text[1:]
    # A full stop ends it; the ones of "e.g." and "i.e." do not.
    end = re.search(r"(?<![ .(][a-z]\.[a-z])(?<=[a-z0-9)\]])\.(\s|$)", text)
    sentence = text[: end.start() + 1] if end else text
    return sentence if len(sentence) <= width else sentence[: width - 1].rstrip() + "…"


def defaults() -> dict[str, str]:
    """group -> the option conf/config.yaml selects."""
    import yaml

    root = yaml.safe_load((config_folder("conf") / "config.yaml").read_text())
    out = {}
    for entry in root.get("defaults", []):
        if isinstance(entry, dict):
            out.update({str(k): str(v) for k, v in entry.items()})
    return out


def groups() -> dict[str, list[Path]]:
    conf = config_folder("conf")
    found: dict[str, list[Path]] = {}
    for f in sorted(conf.rglob("*.yaml")):
        # Hydra's job logging is the runner's own, not a user's choice.
        if f.parent != conf and f.parent.name != "job_logging":
            found.setdefault(f.parent.relative_to(conf).as_posix(), []).append(f)
    return found


def list_all() -> str:
    import shutil

    width = max(40, shutil.get_terminal_size((120, 24)).columns - 42)
    chosen = defaults()
    out = ["Config groups (choose with group=option; * marks the default):"]
    for group, files in groups().items():
        for i, f in enumerate(files):
            mark = "*" if chosen.get(group) == f.stem else " "
            name = group if i == 0 else ""
            out.append(f"  {name:<16}{mark} {f.stem:<20} {first_sentence(header(f), width)}")
    out.append("")
    out.append("Sweeps (run with: eagle3-runner -m -cn NAME [overrides]):")
    for f in sorted(config_folder("sweeps").glob("*.yaml")):
        out.append(f"  {f.stem:<22} {first_sentence(header(f), width + 16)}")
    out.append("")
    out.append("One group in full: eagle3-runner ls GROUP; one key: eagle3-runner ls train.lr")
    return "\n".join(out)


def list_group(group: str) -> str:
    files = groups()[group]
    chosen = defaults().get(group)
    out = [f"{group} (choose with {group}=OPTION):"]
    for f in files:
        mark = " (default)" if f.stem == chosen else ""
        out.append(f"\n  {f.stem}{mark}")
        out.extend(textwrap.wrap(header(f), 92, initial_indent="    ", subsequent_indent="    "))
    return "\n".join(out)


def field_comment(cls: type, name: str) -> str:
    """The comment lines right above `name: ...` in `cls`'s source (how the schema documents
    its fields), or the one after it on the same line."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return ""
    for i, line in enumerate(lines):
        if re.match(rf"\s+{re.escape(name)}\s*:", line):
            above = []
            for prev in reversed(lines[:i]):
                if not prev.strip().startswith("#"):
                    break
                above.insert(0, prev.strip().lstrip("#").strip())
            inline = line.split("#", 1)[1].strip() if "#" in line else ""
            return " ".join([*above, inline]).strip()
    return ""


def yaml_comment(path: Path, name: str) -> str:
    """The comment on `name:`'s line in a config file, or the comment lines right above it (not
    the file's own header)."""
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if not re.match(rf"\s*{re.escape(name)}\s*:", line):
            continue
        if "#" in line:
            return line.split("#", 1)[1].strip()
        j = i
        while j > 0 and lines[j - 1].strip().startswith("#"):
            j -= 1
        return "" if j == 0 else " ".join(x.strip().lstrip("#").strip() for x in lines[j:i])
    return ""


def _section_type(kind: Any) -> type | None:
    """The dataclass behind a field's annotation (through Optional), if any."""
    for k in (kind, *typing.get_args(kind)):
        if dataclasses.is_dataclass(k):
            return k  # type: ignore[return-value]
    return None


def _type_name(kind: Any) -> str:
    if isinstance(kind, type) and issubclass(kind, str) and kind is not str:  # a StrEnum
        return "one of " + ", ".join(str(m.value) for m in kind)  # type: ignore[attr-defined]
    text = getattr(kind, "__name__", None) if isinstance(kind, type) else None
    return text or str(kind).replace("typing.", "")


def describe_key(key: str, overrides: list[str]) -> str:
    """One key's help: type, value in the composed config, where it is set, the comment."""
    from omegaconf import OmegaConf

    from runner.composition import compose_root
    from runner.core.schema import schema_for

    cls: Any = schema_for(compose_root())
    parts = key.split(".")
    owner, kind = cls, None
    for i, part in enumerate(parts):
        if owner is None:
            raise KeyError(key)
        hints = typing.get_type_hints(owner)
        if part not in hints:
            known = ", ".join(f.name for f in dataclasses.fields(owner))
            where = ".".join(parts[:i]) or "the root"
            raise KeyError(f"{key}: no key {part!r} in {where}; it takes: {known}")
        kind = hints[part]
        if i < len(parts) - 1:
            owner = _section_type(kind)
    cfg = compose(overrides)
    value = OmegaConf.select(cfg, key, default="<unset>")
    if OmegaConf.is_config(value):
        value = "\n" + textwrap.indent(OmegaConf.to_yaml(value).strip(), " " * 11)
    origin = _set_in(parts, cfg, owner)
    lines = [
        key,
        f"  type:    {_type_name(kind)}",
        f"  value:   {value}" + (f"   (with {' '.join(overrides)})" if overrides else ""),
        f"  set in:  {origin}",
    ]
    section = _section_type(kind)
    if section is not None:
        lines.append("  keys:    " + ", ".join(f.name for f in dataclasses.fields(section)))
    comment = field_comment(owner, parts[-1])
    if not comment and origin.endswith(".yaml"):  # the file that sets it may say why
        comment = yaml_comment(config_folder("conf").parent / origin, parts[-1])
    if comment:
        lines.extend(textwrap.wrap(comment, 92, initial_indent="  ", subsequent_indent="  "))
    return "\n".join(lines)


def _set_in(parts: list[str], cfg: Any, owner: Any = None) -> str:
    """The group file (as selected) whose YAML sets the key, else the schema's default."""
    import yaml

    group = parts[0]
    choice = cfg.get("hydra", {}).get("runtime", {}).get("choices", {}).get(group)
    if choice is None:
        choice = defaults().get(group)
    conf = config_folder("conf")
    candidates = [conf / group / f"{choice}.yaml"] if choice else []
    candidates.append(conf / "config.yaml")
    for f in candidates:
        if not f.is_file():
            continue
        node: Any = yaml.safe_load(f.read_text()) or {}
        path = parts[1:] if f.parent.name == group else parts
        for p in path:
            node = node.get(p, KeyError) if isinstance(node, dict) else KeyError
        if node is not KeyError:
            return f"{f.relative_to(conf.parent)}"
    module = getattr(owner, "__module__", "runner.core.schema")
    return f"the schema's default ({module.replace('.', '/')}.py)"


def compose(overrides: list[str]) -> Any:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_folder("conf")), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="eagle3-runner ls", description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", help="a config group (model) or a key (train.lr)")
    ap.add_argument("overrides", nargs="*", help="as on the runner's command line")
    args = ap.parse_args(argv)
    if args.what is None:
        print(list_all())
        return 0
    if args.what in groups():
        print(list_group(args.what))
        return 0
    try:
        print(describe_key(args.what, args.overrides))
    except KeyError as exc:
        msg = exc.args[0]
        if "." not in args.what:
            msg = f"{args.what}: neither a config group ({', '.join(groups())}) nor a key"
        print(f"ls: {msg}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
