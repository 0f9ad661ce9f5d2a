"""A local target's weight files read as a whole without loading a tensor: the shards its
index names exist, and the shapes their headers give agree with config.json.

A folder whose config.json claims more layers than its weights hold loads without a word in
transformers (the missing layers are initialised at random) and extraction then writes hidden
states of a model that does not exist. Here the plan refuses it, naming the file and the key.
Only safetensors are read (their headers are JSON before the data); other formats, hub ids and
packaged GGUF files are checked where they are loaded.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

from runner.core.errors import ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# A header larger than this is not a safetensors header (the format caps it at 100 MB).
HEADER_MAX = 100_000_000


def header(path: Path) -> dict[str, Any]:
    """The tensors' names, dtypes and shapes in one safetensors file: its 8-byte length and the
    JSON after it, nothing of the data."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ConfigError("model.source", f"{path} is not a safetensors file (too short)")
        (size,) = struct.unpack("<Q", raw)
        if size > HEADER_MAX:
            raise ConfigError("model.source", f"{path} is not a safetensors file (its header)")
        try:
            found = json.loads(fh.read(size))
        except ValueError as exc:
            raise ConfigError("model.source", f"{path}: its safetensors header: {exc}") from None
    found.pop("__metadata__", None)
    return found


def tensors(folder: Path) -> tuple[dict[str, list[int]], str] | None:
    """{tensor name: shape} of a folder's safetensors weights and the file that lists them (the
    index, or the single file); None where the folder holds none. A shard the index names that
    is missing is refused here."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError("model.source", f"{index}: not a weight index ({exc})") from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ConfigError(
                "model.source",
                f"{index} names {len(shards)} shard(s); {len(missing)} missing from {folder}: "
                f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} (a download that "
                "did not finish?)",
            )
        shapes: dict[str, list[int]] = {}
        for shard in shards:
            for name, info in header(folder / shard).items():
                shapes[name] = list(info.get("shape", []))
        return shapes, INDEX
    if (folder / SINGLE).is_file():
        return {n: list(i.get("shape", [])) for n, i in header(folder / SINGLE).items()}, SINGLE
    return None


def check_weights(folder: Path, layers: str, embed: str, config: dict[str, int]) -> None:
    """The weights against config.json's text model: as many decoder layers as
    num_hidden_layers (under the layout's `layers` path), and an embedding of [vocab_size,
    hidden_size]. `config`: num_layers, hidden_size, vocab_size as config.json gives them."""
    found = tensors(folder)
    if found is None:
        return
    shapes, listed = found
    where = folder / listed
    held = _layer_indices(shapes, layers)
    n = config["num_layers"]
    if held is not None and held != set(range(n)):
        lacking = sorted(set(range(n)) - held)
        extra = sorted(held - set(range(n)))
        said = f"config.json says num_hidden_layers={n}"
        if lacking:
            raise ConfigError(
                "model.source",
                f"{said}, but {where} holds no weights for layer(s) {_ranges(lacking)} (it holds "
                f"{len(held)}): they would be initialised at random; fix config.json or the files",
            )
        raise ConfigError(
            "model.source", f"{said}, but {where} also holds layer(s) {_ranges(extra)}"
        )
    shape = shapes.get(f"{embed}.weight")
    if shape and len(shape) == 2:
        want = [config["vocab_size"], config["hidden_size"]]
        if shape != want:
            raise ConfigError(
                "model.source",
                f"config.json says vocab_size={want[0]}, hidden_size={want[1]}, but "
                f"{embed}.weight in {where} is {shape[0]} x {shape[1]}",
            )


def _layer_indices(shapes: dict[str, list[int]], layers: str) -> set[int] | None:
    """Decoder layer indices that hold weights, under `layers` (e.g. model.layers), else under
    its last two parts (a checkpoint saved without the wrapper); None where no name matches."""
    parts = layers.split(".")
    for prefix in (layers, ".".join(parts[-2:])):
        rx = re.compile(rf"(?:^|\.){re.escape(prefix)}\.(\d+)\.")
        held = {int(m.group(1)) for name in shapes if (m := rx.search(name))}
        if held:
            return held
    return None


def _ranges(ids: list[int]) -> str:
    out, start = [], ids[0]
    for a, b in zip(ids, [*ids[1:], None], strict=True):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)
