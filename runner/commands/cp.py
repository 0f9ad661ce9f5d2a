"""A shipped preset or sweep as a file of your own to edit: `eagle3-runner cp`.

    eagle3-runner cp train/eagle3_gpu my_conf/train/long.yaml     # then: train=long
    eagle3-runner cp sweeps/capture_layers my_sweeps/layers.yaml  # then: -m -cn layers

Copies the file the runner composes from (conf/GROUP/OPTION.yaml, or sweeps/NAME.yaml) and says
the command that uses the copy: Hydra finds it with `--config-dir`, a config group's option in
a folder named after the group. Refuses to overwrite a file.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from runner.commands.ls import config_folder, groups


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eagle3-runner cp", description=__doc__.splitlines()[0])
    ap.add_argument("what", help="GROUP/OPTION (train/eagle3_gpu) or sweeps/NAME")
    ap.add_argument("dest", type=Path, help="the new file (.yaml)")
    args = ap.parse_args(argv)
    group, _, name = args.what.removesuffix(".yaml").partition("/")
    if group == "sweeps":
        src = config_folder("sweeps") / f"{name}.yaml"
    elif group in groups():
        src = config_folder("conf") / group / f"{name}.yaml"
    else:
        ap.error(f"{args.what!r}: give GROUP/OPTION (groups: {', '.join(groups())}) or sweeps/NAME")
    if not name or not src.is_file():
        where = src.parent
        known = ", ".join(sorted(p.stem for p in where.glob("*.yaml") if p.stem != "__init__"))
        ap.error(f"{args.what!r}: no such file; {where.name}/ has {known}")
    dest = args.dest if args.dest.suffix == ".yaml" else args.dest / src.name
    if dest.exists():
        ap.error(f"{dest} exists; give a new file")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    print(f"copied {src} to {dest}")
    folder, stem = dest.parent.resolve(), dest.stem
    if group == "sweeps":
        print(f"use it: eagle3-runner -m --config-dir {folder} -cn {stem}")
    elif dest.parent.name == group:
        print(f"use it: eagle3-runner --config-dir {folder.parent} {group}={stem}")
    else:
        print(
            f"use it: move it to a folder named {group}/ (e.g. my_conf/{group}/{stem}.yaml), then "
            f"eagle3-runner --config-dir my_conf {group}={stem}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
