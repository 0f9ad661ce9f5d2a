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
    if not isinstance(found, dict):
        raise ConfigError("model.source", f"{path}: its safetensors header is not an object")
    found.pop("__metadata__", None)
    # The header's offsets against the file's length: a copy cut short (a download or a full
    # disk) is named now, not when a loader reads past its end (free: one stat).
    ends = [
        int(info["data_offsets"][1])
        for info in found.values()
        if isinstance(info, dict) and len(info.get("data_offsets") or ()) == 2
    ]
    need = 8 + size + max(ends, default=0)
    have = path.stat().st_size
    if have < need:
        raise ConfigError(
            "model.source",
            f"{path} is {have:,} bytes, but its header places tensors up to byte {need:,}: the "
            "file was cut short (a download or copy that did not finish); fetch it again",
        )
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


# A meta-device model is built from config.json to know every tensor's shape; above this many
# experts in all (DeepSeek-V3: 58 x 256) building it takes longer than a plan should, and the
# layer count and embedding checks above are what is checked.
EXPERTS_MAX = 4096


def declared_shapes(config: dict[str, Any]) -> dict[str, list[int]] | None:
    """{tensor name: shape} of the model config.json describes, built on the meta device (no
    memory, no weights) by transformers' own class for it; None where transformers has no class
    of its own for the architecture (custom code is not run for a check) or the model is too
    large to build in a plan."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    layers = int(config.get("num_hidden_layers") or 0)
    experts = int(config.get("n_routed_experts") or config.get("num_experts") or 0)
    if layers * experts > EXPERTS_MAX or "auto_map" in config:
        return None
    try:
        kind = config["model_type"]
        made = AutoConfig.for_model(kind, **{k: v for k, v in config.items() if k != "model_type"})
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(made)
    except Exception:  # an architecture transformers builds no causal LM for: not checked here
        return None
    return {name: list(t.shape) for name, t in model.state_dict().items()}


def check_shapes(folder: Path, config: dict[str, Any]) -> None:
    """Every tensor of the folder's weights whose name the model declares has the shape
    config.json gives it (a wider MLP or another head count than the weights hold is named,
    with the file, before anything loads). Quantized checkpoints' packed tensors carry other
    names and are not compared."""
    found = tensors(folder)
    if found is None:
        return
    shapes, listed = found
    declared = declared_shapes(config)
    if not declared:
        return
    common = [n for n in shapes if n in declared]
    wrong = [n for n in common if shapes[n] and shapes[n] != declared[n]]
    if wrong:
        name = wrong[0]
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise ConfigError(
            "model.source",
            f"{name} in {folder / listed} is {shapes[name]}, but config.json's settings make it "
            f"{declared[name]}{more}: config.json does not describe these weights (another "
            "model's config, or a hand-edited size); fix config.json or the files",
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
