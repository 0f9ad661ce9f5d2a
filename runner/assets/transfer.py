"""Move drafts and stage artifacts between machines, each checked where it arrives.

A trained draft travels without the copy of the target's embeddings it holds (pack, unpack); any
stage's artifact travels between output roots with its manifest (export, import).

    eagle3-runner transfer pack DRAFT_DIR OUT_DIR --target TARGET
    eagle3-runner transfer unpack OUT_DIR.packed DRAFT_DIR --target TARGET
    eagle3-runner transfer export regenerate[:KEY] OUT_DIR --output-root ROOT
    eagle3-runner transfer import OUT_DIR OTHER_ROOT
(`python -m runner.assets.transfer` is the same tool.) TARGET is the target's model folder or its
hub
id (e.g. moonshotai/Kimi-K2.5): from the hub only the files that hold the tensors the draft shares
are fetched (through huggingface_hub's cache; offline, a cached copy serves).

An EAGLE-3 draft stores the target's input embedding table (frozen while training): for
SmolLM2-135M 57 MB of its 76 MB, for Kimi-K2.5 2.3 GB. `pack` writes the draft without every
tensor that is byte-identical to one of the target's (found by comparing, not by name), recording
for each the target's tensor name and sha256 in `packed.json`. `unpack` on the other machine reads
those tensors from its own copy of the target, refuses if any differs from what was recorded
(another target, or other weights), and writes the complete draft folder, which speculators and
vLLM load as usual. Both write beside OUT_DIR and rename it into place.

A packed folder cannot be served as it is: its name ends in `.packed` (added when OUT_DIR lacks
it) and it holds NEEDS_UNPACKING.txt with the command that restores it; `publish` and the
evaluate stage's plan (eval.draft) refuse it.

Evaluate a draft that was trained elsewhere with `python -m runner eval.draft=OUT_DIR
run.stages=[evaluate]` (the same model, hardware and eval settings as any run).

`export` copies a published artifact of a stage (its newest, or the one of KEY) with its
manifest, after checking every file's sha256 against it; `import` places it in another root's
store under its own stage and key once every file matches again. A run there with the same
settings, target weights and libraries computes the same key and reuses it: the target's answers
regenerated once on one machine (`regenerate=vllm`), each training arm on a machine of its own.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from runner.assets.target_facts import hub_repo_id
from runner.core.interrupts import companion
from runner.core.layout import default_root
from runner.core.store import MANIFEST as STORE_MANIFEST
from runner.core.store import Artifact, ArtifactStore, damage, new_folder

WEIGHTS = "model.safetensors"
MANIFEST = "packed.json"
PACKED_SUFFIX = ".packed"
MARKER = "NEEDS_UNPACKING.txt"
# The only target tensors an EAGLE-3 draft holds copies of: what `pack` looks for in a hub
# target's shards (a local target is searched whole, by content).
SHARED_TENSORS = ("embed_tokens.weight", "lm_head.weight")


def refuse_links_out(folder: Path) -> None:
    """A symlink in a folder about to be shipped that points outside it would ship whatever it
    points to (a notes.txt linked to /etc/hostname shipped the host's name): refused, naming the
    file. Links that stay inside the folder are copied as the files they point to."""
    root = folder.resolve()
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            target = path.resolve()
            if target != root and root not in target.parents:
                raise ValueError(
                    f"{path} is a link to {target}, outside {folder}: replace it with the file "
                    "itself or remove it (nothing is shipped from outside the draft's folder)"
                )


def packed_reason(folder: Path) -> str | None:
    """Why `folder` is not a servable draft but a packed one (None if it is not packed)."""
    if (folder / MANIFEST).is_file() or (folder / MARKER).is_file():
        return (
            f"{folder} is a packed draft (the target's tensors were left out); unpack it first: "
            f"eagle3-runner transfer unpack {folder} OUT_DIR --target TARGET"
        )
    return None


def target_files(target: str | Path, names: set[str] | None = None) -> dict[str, Path]:
    """The target's .safetensors files, name -> local path: a folder's own, or a hub id's from
    huggingface_hub's cache (fetched if missing and online). `names`: only those files (unpack);
    for a hub id without `names`, the shards holding the tensors a draft shares (pack)."""
    folder = Path(target).expanduser()
    if folder.is_dir():
        found = {f.name: f for f in sorted(folder.glob("*.safetensors"))}
        if not found:
            raise FileNotFoundError(f"no .safetensors file in the target folder {folder}")
        return {n: f for n, f in found.items() if names is None or n in names}
    if hub_repo_id(str(target)) is None:
        raise FileNotFoundError(f"--target {target}: neither a folder nor a hub id (org/name)")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    def fetch(name: str) -> Path:
        try:
            return Path(hf_hub_download(str(target), name))
        except EntryNotFoundError:
            raise
        except Exception as exc:  # offline without a cached copy, no such repo, no access
            raise FileNotFoundError(
                f"--target {target}: cannot get {name} from the hub or its cache ({exc}); give "
                "the target's local folder instead"
            ) from None

    if names is None:
        try:
            index = json.loads(fetch("model.safetensors.index.json").read_text())["weight_map"]
            names = {f for t, f in index.items() if t.endswith(SHARED_TENSORS)}
        except EntryNotFoundError:  # one unsharded file
            names = {WEIGHTS}
    return {n: fetch(n) for n in sorted(names)}


def _sha256(t: Any) -> str:
    """Of the tensor's bytes (any dtype, bf16 included)."""
    import torch

    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def _find_in_target(tensor: Any, files: dict[str, Path]) -> tuple[str, str] | None:
    """(file name, tensor name) of a tensor of the target equal to `tensor`, if any."""
    import torch
    from safetensors import safe_open

    for f in files.values():
        with safe_open(str(f), "pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open is not iterable)
                sl = fh.get_slice(name)
                if tuple(sl.get_shape()) != tuple(tensor.shape):
                    continue
                other = fh.get_tensor(name)
                if other.dtype == tensor.dtype and torch.equal(other, tensor):
                    return f.name, name
    return None


def packed_name(out: Path) -> Path:
    """OUT_DIR as `pack` writes it: its name says that it needs unpacking."""
    return out if out.name.endswith(PACKED_SUFFIX) else out.with_name(out.name + PACKED_SUFFIX)


def pack(draft: Path, out: Path, target: str | Path) -> dict[str, Any]:
    from safetensors.torch import load_file, save_file

    if packed_reason(draft):
        raise ValueError(f"{draft} is already packed")
    refuse_links_out(draft)
    out = packed_name(out)
    files = target_files(target)
    weights = load_file(str(draft / WEIGHTS))
    omitted: dict[str, Any] = {}
    for name, t in weights.items():
        if t.numel() < 1 << 16:  # small tensors travel as they are
            continue
        where = _find_in_target(t, files)
        if where is not None:
            omitted[name] = {
                "file": where[0],
                "tensor": where[1],
                "sha256": _sha256(t),
                "shape": list(t.shape),
                "dtype": str(t.dtype),
            }
    with new_folder(out) as tmp:
        for f in draft.iterdir():
            if f.is_file() and f.name != WEIGHTS:
                shutil.copy2(f, tmp / f.name)
        save_file(
            {k: v for k, v in weights.items() if k not in omitted},
            str(tmp / WEIGHTS),
            metadata={"format": "pt"},
        )
        record = {"omitted": omitted, "target_hint": str(target), "out": str(out)}
        (tmp / MANIFEST).write_text(json.dumps(record, indent=1))
        # A hub id restores anywhere; a local folder is named by its last part only (its
        # path is the packing machine's).
        hub = hub_repo_id(str(target))
        (tmp / MARKER).write_text(
            "This EAGLE-3 draft is packed: the tensors it shares with its target were left out\n"
            f"(listed in {MANIFEST}), so it cannot be served or published as it is. Restore it:\n"
            f"    eagle3-runner transfer unpack {out.name} DRAFT_DIR --target {hub or 'TARGET'}\n"
            + (
                ""
                if hub
                else f"TARGET: the target's folder on this machine (packed against a local "
                f"folder named {Path(target).name}).\n"
            )
        )
    return record


def unpack(packed: Path, out: Path, target: str | Path) -> dict[str, Any]:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    refuse_links_out(packed)
    if not (packed / MANIFEST).is_file():
        raise FileNotFoundError(f"{packed} is not a packed draft (no {MANIFEST})")
    record = json.loads((packed / MANIFEST).read_text())
    files = target_files(target, {how["file"] for how in record["omitted"].values()})
    weights = load_file(str(packed / WEIGHTS))
    for name, how in record["omitted"].items():
        path = files.get(how["file"], Path(str(target)) / how["file"])
        try:
            with safe_open(str(path), "pt") as fh:
                t = fh.get_tensor(how["tensor"])
        except Exception as exc:  # a missing file or tensor: safetensors raises several kinds
            raise ValueError(
                f"{path}: no tensor {how['tensor']} ({exc}); is {target} the "
                "target this draft was trained for?"
            ) from None
        if _sha256(t) != how["sha256"]:
            raise ValueError(
                f"{how['tensor']} of {target} differs from the one the draft was trained with "
                f"(sha256 {how['sha256'][:12]}); it needs the same target weights"
            )
        weights[name] = t
    with new_folder(out) as tmp:
        for f in packed.iterdir():
            if f.is_file() and f.name not in (WEIGHTS, MANIFEST, MARKER):
                shutil.copy2(f, tmp / f.name)
        save_file(weights, str(tmp / WEIGHTS), metadata={"format": "pt"})
    return record


def export(root: Path, which: str, out: Path) -> Artifact:
    """A stage's published artifact (`stage:key`, or `stage` for its newest) copied to `out`,
    manifest included, after every file was checked against it (sha256)."""
    stage, _, key = which.partition(":")
    store = ArtifactStore(root)
    art = store.get(stage, key) if key else store.latest(stage)
    if art is None:
        raise FileNotFoundError(
            f"no finished {stage} artifact{' ' + key if key else ''} in {store.root} "
            "(eagle3-runner ls and the run's manifests name the keys)"
        )
    wrong = damage(art, full=True)
    if wrong is not None:
        raise ValueError(f"{art.path} is damaged ({wrong}): nothing exported")
    refuse_links_out(art.path)
    with new_folder(out) as tmp:
        shutil.copytree(art.path, tmp, dirs_exist_ok=True)
    return art


def import_artifact(src: Path, root: Path) -> Artifact:
    """An exported artifact placed in `root`'s store under its own stage and key, once every
    file matches its manifest: a run there with the same settings reuses it as if computed
    there (the key is the settings', the target's weights' and the libraries')."""
    try:
        manifest = json.loads((src / STORE_MANIFEST).read_text())
        stage, key = str(manifest["stage"]), str(manifest["key"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{src} is not an exported artifact ({STORE_MANIFEST}: {exc})") from None
    refuse_links_out(src)
    store = ArtifactStore(root)
    final = store.path(stage, key)
    if store.get(stage, key) is not None:
        raise FileExistsError(f"{stage} {key} is already in {store.root}: nothing to import")
    tmp = final.parent / f".tmp-{key}-import-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(src, tmp)
        wrong = damage(Artifact(stage, key, tmp), full=True)
        if wrong is not None:
            raise ValueError(f"{src} does not match its manifest ({wrong}): nothing imported")
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Artifact(stage, key, final)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="eagle3-runner transfer",
        description=__doc__.splitlines()[0],
        epilog="export/import: any stage's artifact (e.g. a regeneration made on another machine) "
        "moved with its manifest and checked by it",
    )
    ap.add_argument("action", choices=("pack", "unpack", "export", "import"))
    ap.add_argument(
        "src",
        help="pack: the draft folder; unpack: the packed one; export: STAGE or STAGE:KEY of "
        "--output-root's store; import: the exported folder",
    )
    ap.add_argument(
        "out",
        type=Path,
        help="pack/unpack/export: the folder to write (must not exist, or be empty; pack adds "
        ".packed); import: the output root whose store receives it",
    )
    ap.add_argument("--target", help="pack/unpack: the target's model folder, or its hub id")
    ap.add_argument(
        "--output-root",
        type=Path,
        default=Path(default_root()),
        metavar="DIR",
        help="export: the output root to read (default: $EAGLE3_RUNNER_HOME, else ./outputs)",
    )
    args = ap.parse_args(argv)
    if args.action in ("pack", "unpack") and not args.target:
        ap.error(f"{args.action} needs --target (the target's model folder, or its hub id)")
    return companion("transfer", lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    try:
        if args.action in ("export", "import"):
            if args.action == "export":
                art = export(args.output_root.expanduser(), args.src, args.out)
                where = args.out
            else:
                art = import_artifact(Path(args.src), args.out.expanduser())
                where = art.path
            print(f"{args.action}ed {art.stage} {art.key} -> {where}")
            return 0
        if args.action == "pack":
            rec = pack(Path(args.src), args.out, args.target)
        else:
            rec = unpack(Path(args.src), args.out, args.target)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"transfer: {exc}", file=sys.stderr)
        return 1
    out = Path(rec.get("out", args.out)) if args.action == "pack" else args.out
    size = (out / WEIGHTS).stat().st_size
    names = ", ".join(f"{k} (= target's {v['tensor']})" for k, v in rec["omitted"].items())
    verb = "left out" if args.action == "pack" else "restored"
    print(f"{args.action}ed {args.src} -> {out} ({size / 1e6:.1f} MB); {verb}: {names or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
