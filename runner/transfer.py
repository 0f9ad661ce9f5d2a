"""Move a trained draft between machines without the copy of the target's embeddings it holds.

    python -m runner.transfer pack DRAFT_DIR OUT_DIR --target TARGET_DIR
    python -m runner.transfer unpack PACKED_DIR OUT_DIR --target TARGET_DIR

An EAGLE-3 draft stores the target's input embedding table (frozen while training): for
SmolLM2-135M 57 MB of its 76 MB, for Kimi-K2.5 2.3 GB. `pack` writes the draft without every
tensor that is byte-identical to one of the target's (found by comparing, not by name), recording
for each the target's tensor name and sha256 in `packed.json`. `unpack` on the other machine reads
those tensors from its own copy of the target, refuses if any differs from what was recorded
(another target, or other weights), and writes the complete draft folder, which speculators and
vLLM load as usual. Both write beside OUT_DIR and rename it into place.

Evaluate a draft that was trained elsewhere with `python -m runner eval.draft=OUT_DIR
run.stages=[evaluate]` (the same model, hardware and eval settings as any run).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from runner.interrupts import companion
from runner.store import new_folder

WEIGHTS = "model.safetensors"
MANIFEST = "packed.json"


def _sha256(t: Any) -> str:
    """Of the tensor's bytes (any dtype, bf16 included)."""
    import torch

    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def _target_files(target: Path) -> list[Path]:
    files = sorted(target.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in the target folder {target}")
    return files


def _find_in_target(tensor: Any, target: Path) -> tuple[str, str] | None:
    """(file name, tensor name) of a tensor of the target equal to `tensor`, if any."""
    import torch
    from safetensors import safe_open

    for f in _target_files(target):
        with safe_open(str(f), "pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open is not iterable)
                sl = fh.get_slice(name)
                if tuple(sl.get_shape()) != tuple(tensor.shape):
                    continue
                other = fh.get_tensor(name)
                if other.dtype == tensor.dtype and torch.equal(other, tensor):
                    return f.name, name
    return None


def pack(draft: Path, out: Path, target: Path) -> dict[str, Any]:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(draft / WEIGHTS))
    omitted: dict[str, Any] = {}
    for name, t in weights.items():
        if t.numel() < 1 << 16:  # small tensors travel as they are
            continue
        where = _find_in_target(t, target)
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
        record = {"omitted": omitted, "target_hint": str(target)}
        (tmp / MANIFEST).write_text(json.dumps(record, indent=1))
    return record


def unpack(packed: Path, out: Path, target: Path) -> dict[str, Any]:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    record = json.loads((packed / MANIFEST).read_text())
    weights = load_file(str(packed / WEIGHTS))
    for name, how in record["omitted"].items():
        path = target / how["file"]
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
            if f.is_file() and f.name not in (WEIGHTS, MANIFEST):
                shutil.copy2(f, tmp / f.name)
        save_file(weights, str(tmp / WEIGHTS), metadata={"format": "pt"})
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eagle3-runner transfer", description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("pack", "unpack"))
    ap.add_argument("src", type=Path, help="the draft folder (pack) or the packed one (unpack)")
    ap.add_argument("out", type=Path, help="the folder to write (must not exist, or be empty)")
    ap.add_argument("--target", type=Path, required=True, help="the target's model folder")
    args = ap.parse_args(argv)
    return companion("transfer", lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    try:
        if args.action == "pack":
            rec = pack(args.src, args.out, args.target)
        else:
            rec = unpack(args.src, args.out, args.target)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"transfer: {exc}", file=sys.stderr)
        return 1
    size = (args.out / WEIGHTS).stat().st_size
    names = ", ".join(f"{k} (= target's {v['tensor']})" for k, v in rec["omitted"].items())
    verb = "left out" if args.action == "pack" else "restored"
    print(f"{args.action}ed {args.src} -> {args.out} ({size / 1e6:.1f} MB); {verb}: {names or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
