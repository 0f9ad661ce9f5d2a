"""Wheels for an air-gapped machine (a GPU cluster, the measurement boxes), and their install.

Build, here (with the package registry), for another machine's Python and platform, from the
project's own dependency list, leaving out what that machine already has:

    python scripts/wheelhouse.py build wheelhouse/ --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --have have.txt [--extra gpu] [--exclude vllm]

`have.txt` lists the other machine's packages, one per line: `python3 -m pip freeze` run there
(versions are then kept: this machine resolves against them), or bare names. The project
itself is built as a wheel too. Dependencies are resolved with this machine's pip and Python
against those constraints, then each missing one is downloaded for the target platform (a pure
Python sdist, such as antlr4's, is built into a wheel here).

Install, there (no network):

    python3 scripts/wheelhouse.py install wheelhouse/ [--target DIR]

Carry, over a link that takes files of a limited size (a transfer service, removable media):
`bundle` cuts a folder into pieces of at most `--piece-mib` MiB (default 60) with their
checksums, `missing` says which pieces have not arrived yet, and `unbundle` joins and checks them
on the other side (docs/install.md).

    python scripts/wheelhouse.py bundle wheelhouse/ pieces/ --piece-mib 500
    python3 scripts/wheelhouse.py unbundle pieces/ wheelhouse/

`make wheelhouse` builds one for a Python 3.12 GPU machine (`dev/gpu-bundle.sh`: the tested GPU set,
in pieces).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
# Compatible manylinux tags, newest first; pip matches each exactly.
MANYLINUX = ["manylinux_2_28", "manylinux_2_27", "manylinux_2_17", "manylinux2014", "manylinux1"]


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_have(path: Path | None) -> tuple[set[str], list[str]]:
    """(names the target has, `name==version` for those listed with a version)."""
    names, pins = set(), []
    for line in path.read_text().splitlines() if path else []:
        line = line.split("#")[0].strip()
        if not line or line.startswith("-"):
            continue
        m = re.match(r"([A-Za-z0-9_.\-]+)(?:\[.*\])?\s*(?:==\s*([^\s;]+))?", line)
        if not m:
            continue
        names.add(normalise(m.group(1)))
        if m.group(2):
            pins.append(
                f"{m.group(1)}=={m.group(2).split('+')[0]}"
            )  # local labels (+cu130) dropped
    return names, pins


def project_requirements(extras: list[str]) -> list[str]:
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(meta["dependencies"])
    for extra in extras:
        reqs += meta.get("optional-dependencies", {}).get(extra, [])
    return reqs


def pip(*args: str, quiet: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *(["-q"] if quiet else [])]
    return subprocess.run([*cmd, *args], capture_output=True, text=True)


def _requires(wheel: Path, env: dict[str, str]) -> list[Requirement]:
    """A wheel's dependencies that apply on the target (markers evaluated for it)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    reqs = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
                reqs.append(req)
    return reqs


def _fetch(
    req: Requirement,
    out: Path,
    target: list[str],
    tested: dict[str, str],
    pinned: dict[str, str] | None = None,
) -> Path:
    """The wheel for `req` on the target: downloaded, or built here from a pure-Python sdist.
    A version the constraints pin (the set run on the target) wins; else the version this
    environment runs (the one the tests pass with) is preferred."""
    mine = (pinned or {}).get(normalise(req.name)) or tested.get(normalise(req.name))
    ok = mine is not None and req.specifier.contains(mine, prereleases=True)
    spec = f"{req.name}=={mine}" if ok else f"{req.name}{req.specifier}"
    with tempfile.TemporaryDirectory() as tmp:
        r = pip("download", "--no-deps", "-d", tmp, *target, spec)
        if r.returncode:  # no wheel for that platform: a pure-Python sdist builds here
            r = pip("wheel", "--no-deps", "-w", tmp, spec)
            if r.returncode:
                sys.exit(f"no wheel of {spec} for the target:\n{r.stderr[-2000:]}")
        (wheel,) = Path(tmp).glob("*.whl")
        dest = out / wheel.name
        wheel.replace(dest)
    return dest


def build(args: argparse.Namespace) -> int:
    """Walk the dependency graph from the project's requirements, down to what the target has
    (a package it has is not entered, so torch's CUDA libraries are never resolved here). The
    first version that satisfies a requirement is taken; a later, narrower requirement that it
    does not satisfy stops the build with both named."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    have, _ = read_have(Path(args.have) if args.have else None)
    skip = {normalise(x) for x in args.exclude} | have
    platforms = [f"--platform={p}_{args.arch}" for p in MANYLINUX] + ["--platform=any"]
    target = [
        "--python-version",
        args.python_version,
        "--implementation",
        "cp",
        "--only-binary=:all:",
        *platforms,
    ]
    env = {
        **default_environment(),
        "python_version": args.python_version,
        "python_full_version": f"{args.python_version}.0",
        "sys_platform": "linux",
        "platform_machine": args.arch,
        "implementation_name": "cpython",
    }
    tested = {normalise(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    pinned = {}
    for path in args.constraints:
        _, pins = read_have(Path(path))
        pinned.update({normalise(p.split("==")[0]): p.split("==")[1] for p in pins})
    queue = [Requirement(r) for r in project_requirements(args.extra)]
    taken: dict[str, tuple[str, Path]] = {}
    # A constraints file is a set resolved and run on the target: each of its pins is taken as
    # it is (its own needs are in the file, or on the target, or left out on purpose), and the
    # project's needs are resolved against it.
    for name, version in pinned.items():
        if name in skip:
            continue
        wheel = _fetch(Requirement(f"{name}=={version}"), out, target, tested, pinned)
        taken[name] = (version, wheel)
        print(f"  {name}=={version} (constraints)")
    while queue:
        req = queue.pop(0)
        name = normalise(req.name)
        if name in skip:
            continue
        if name in taken:
            version = taken[name][0]
            if not req.specifier.contains(version, prereleases=True):
                sys.exit(f"{req} conflicts with {name}=={version}, taken for an earlier need")
            continue
        wheel = _fetch(req, out, target, tested, pinned)
        version = wheel.name.split("-")[1]
        taken[name] = (version, wheel)
        print(f"  {name}=={version}")
        queue += _requires(wheel, env)
    for spec in args.strip:  # e.g. vllm:vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so
        name, member = spec.split(":", 1)
        for wheel in out.glob(f"{name}-*.whl"):
            strip_member(wheel, member)
    had_build = (REPO / "build").exists()
    r = pip("wheel", "--no-deps", "-w", str(out), str(REPO))
    if not had_build:  # setuptools' scratch folder, not the project's
        shutil.rmtree(REPO / "build", ignore_errors=True)
    if r.returncode:
        sys.exit(f"building the project's wheel failed:\n{r.stderr[-2000:]}")
    wheels = sorted(out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    print(
        f"{len(wheels)} wheels, {size / 2**20:.1f} MiB in {out} "
        f"({len(have)} packages the target has were left out)"
    )
    return 0


def strip_member(wheel: Path, member: str) -> None:
    """`member` removed from `wheel` and from its RECORD (a library the target never loads,
    e.g. vLLM's FlashAttention-2 build on a Hopper GPU, which runs FA3: 304 MB -> 174 MB)."""
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        names = src.namelist()
        if member not in names:
            sys.exit(f"{member} is not in {wheel.name}")
        for info in src.infolist():
            if info.filename == member:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                kept = [r for r in data.decode().splitlines() if not r.startswith(member + ",")]
                data = ("\n".join(kept) + "\n").encode()
            dst.writestr(info, data)
    tmp.replace(wheel)
    print(f"  stripped {member} from {wheel.name} ({wheel.stat().st_size / 2**20:.0f} MiB)")


# A piece of a bundle, unless --piece-mib says otherwise.
PIECE_BYTES = 60 * 2**20


def bundle(args: argparse.Namespace) -> int:
    """The files of `src` (a wheelhouse, plus anything beside it) as one tar cut into pieces of
    at most --piece-mib MiB, with SHA256SUMS of the pieces and of the whole: the pieces travel to
    a machine with no network, one at a time if need be; `unbundle` joins and checks them there."""
    import hashlib
    import tarfile

    src, out = Path(args.src), Path(args.out)
    mib = getattr(args, "piece_mib", None)
    size = int(mib * 2**20) if mib is not None else PIECE_BYTES
    if size <= 0:
        sys.exit("--piece-mib: give a size above 0")
    out.mkdir(parents=True, exist_ok=True)
    whole = out / "bundle.tar"
    with tarfile.open(whole, "w") as tar:
        for f in sorted(src.rglob("*")):
            if f.is_file():
                tar.add(f, arcname=str(f.relative_to(src)))
    sums = []
    digest = hashlib.sha256()
    with open(whole, "rb") as fh:
        for i, chunk in enumerate(iter(lambda: fh.read(size), b"")):
            digest.update(chunk)
            piece = out / f"piece{i:02d}"
            piece.write_bytes(chunk)
            sums.append(f"{hashlib.sha256(chunk).hexdigest()}  {piece.name}")
    sums.append(f"{digest.hexdigest()}  bundle.tar")
    whole.unlink()
    (out / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    print(f"{len(sums) - 1} pieces of <= {size >> 20} MiB in {out}")
    return 0


def piece_sums(pieces: Path) -> dict[str, str]:
    """SHA256SUMS of a bundle's pieces: name to digest (the pieces and the whole bundle.tar)."""
    if not (pieces / "SHA256SUMS").is_file():
        sys.exit(f"{pieces / 'SHA256SUMS'} is missing: carry it with the pieces")
    return dict(reversed(line.split()) for line in (pieces / "SHA256SUMS").read_text().splitlines())


def missing(args: argparse.Namespace) -> int:
    """Say which of a bundle's pieces are here and which are still to carry."""
    pieces = Path(args.pieces)
    names = sorted(n for n in piece_sums(pieces) if n.startswith("piece"))
    lacking = [n for n in names if not (pieces / n).is_file()]
    here = f"pieces here: {len(names) - len(lacking)} of {len(names)}"
    print(f"{here}; missing: {' '.join(lacking)}" if lacking else f"{here}; all here: run setup")
    return 0


def unbundle(args: argparse.Namespace) -> int:
    """Join the pieces in `pieces` (each checked against SHA256SUMS), check the whole, unpack
    it into `out`. A missing or damaged piece is named, and nothing is unpacked."""
    import hashlib
    import tarfile

    pieces, out = Path(args.pieces), Path(args.out)
    sums = piece_sums(pieces)
    names = sorted(n for n in sums if n.startswith("piece"))
    digest = hashlib.sha256()
    joined = out.with_name(out.name + ".tar")
    try:
        with open(joined, "wb") as dst:
            for name in names:
                path = pieces / name
                if not path.is_file():
                    sys.exit(f"piece {name} is missing from {pieces}")
                data = path.read_bytes()
                if hashlib.sha256(data).hexdigest() != sums[name]:
                    sys.exit(f"piece {name} is damaged (sha256 differs from SHA256SUMS)")
                digest.update(data)
                dst.write(data)
        if digest.hexdigest() != sums["bundle.tar"]:
            sys.exit("the joined bundle's sha256 differs from SHA256SUMS")
    except SystemExit:
        joined.unlink(missing_ok=True)  # nothing half-joined is left
        raise
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(joined) as tar:
        tar.extractall(out, filter="data")
    joined.unlink()
    print(f"{len(names)} pieces joined and checked into {out}")
    return 0


def install(args: argparse.Namespace) -> int:
    wheels = sorted(str(w) for w in Path(args.wheelhouse).glob("*.whl"))
    if not wheels:
        sys.exit(f"no wheels in {args.wheelhouse}")
    where = ["--target", args.target] if args.target else []
    r = pip(
        "install",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--upgrade",
        *where,
        *wheels,
        quiet=False,
    )
    sys.stdout.write(r.stdout[-2000:])
    sys.stderr.write(r.stderr[-4000:])
    return r.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build a wheelhouse for another machine")
    b.add_argument("out")
    b.add_argument("--python-version", default="3.12")
    b.add_argument("--arch", default="x86_64")
    b.add_argument("--have", help="the target's `pip freeze` (or package names), left out")
    b.add_argument("--extra", action="append", default=[], help="project extras to include")
    b.add_argument("--exclude", action="append", default=[], help="more packages to leave out")
    b.add_argument("--constraints", action="append", default=[], help="a resolved set, taken as is")
    b.add_argument(
        "--strip", action="append", default=[], help="NAME:MEMBER to remove from a wheel"
    )
    bb = sub.add_parser("bundle", help="cut a folder into checked pieces of <= --piece-mib MiB")
    bb.add_argument("src")
    bb.add_argument("out")
    bb.add_argument("--piece-mib", type=float, default=None, help="largest piece, MiB (60)")
    ub = sub.add_parser("unbundle", help="join and check pieces, unpack them")
    ub.add_argument("pieces")
    ub.add_argument("out")
    m = sub.add_parser("missing", help="which of a bundle's pieces are not here yet")
    m.add_argument("pieces")
    i = sub.add_parser("install", help="install a wheelhouse without network")
    i.add_argument("wheelhouse")
    i.add_argument("--target", help="install into this folder (then put it on PYTHONPATH)")
    args = ap.parse_args()
    commands = {
        "build": build,
        "install": install,
        "bundle": bundle,
        "unbundle": unbundle,
        "missing": missing,
    }
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
