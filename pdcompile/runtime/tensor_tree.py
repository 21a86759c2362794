"""Nested values of tensors and plain data, stored without pickle (exports and checkpoints).

A tree is made of dicts, lists, tuples, tensors, torch dtypes and JSON scalars (None, bool,
int, float, str). `save_tree` writes its tensors to one safetensors file and the rest of the
tree, as JSON, into that file's metadata; `read_tree` reads it back from an open file, once,
showing every byte to a hash as it lands (runtime/verified_read.py checks it against a
manifest), and `load_tree` is the same reader on a path. Reading runs no code from the file
(safetensors and JSON, no pickle), so a file from elsewhere can at worst hold wrong
numbers; a truncated or altered file raises `DamagedFileError` naming it.

`encode` / `decode` are the JSON half on its own: with a `tensors` dict the tensors go there
(keyed by the strings the JSON holds); without, they are written inline as lists of numbers
(for the few small tensors of a JSON file, e.g. a loss function's class weights).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors.torch import save_file

from pdcompile.errors import DamagedFileError

_KEY = "pdcompile.tree"  # the metadata entry holding the JSON skeleton
_SCALARS = (type(None), bool, int, float, str)


class TreeEncodeError(TypeError):
    """A value in a tree that has no pickle-free form (the message says where it sits)."""


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> "float32"."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """"float32" -> `torch.float32` (a name that is not a dtype raises ValueError)."""
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return value


def encode(value: Any, tensors: dict[str, torch.Tensor] | None = None, *, where: str = "value"
           ) -> Any:
    """JSON-able form of `value` (see module docstring); `where` names it in errors."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, torch.Tensor):
        if tensors is None:
            return {"$tensor_data": {"dtype": dtype_name(value.dtype),
                                     "shape": list(value.shape),
                                     "values": value.detach().cpu().reshape(-1).tolist()}}
        key = str(len(tensors))
        tensors[key] = value
        return {"$tensor": key}
    if isinstance(value, torch.dtype):
        return {"$dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    if isinstance(value, tuple):  # torch.Size included
        return {"$tuple": [encode(v, tensors, where=f"{where}[{i}]")
                           for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, tensors, where=f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode(v, tensors, where=f"{where}[{k!r}]") for k, v in value.items()}
        return {"$dict": [[encode(k, tensors, where=f"{where} key"),
                           encode(v, tensors, where=f"{where}[{k!r}]")]
                          for k, v in value.items()]}
    if isinstance(value, set | frozenset):
        return {"$set": [encode(v, tensors, where=where) for v in sorted(value, key=repr)]}
    raise TreeEncodeError(f"{where} is a {type(value).__name__}, which cannot be stored without "
                          "pickle (allowed: tensors, numbers, strings, None, lists, tuples, dicts)")


def decode(data: Any, tensors: dict[str, torch.Tensor] | None = None) -> Any:
    """Inverse of `encode` (raises KeyError / ValueError / TypeError on a malformed tree)."""
    if isinstance(data, _SCALARS):
        return data
    if isinstance(data, list):
        return [decode(v, tensors) for v in data]
    if not isinstance(data, dict):
        raise TypeError(f"unexpected {type(data).__name__} in a stored tree")
    if len(data) == 1:
        (tag, body), = data.items()
        if tag == "$tensor":
            if tensors is None:
                raise ValueError("a tensor reference outside a tensor file")
            return tensors[body]
        if tag == "$tensor_data":
            flat = torch.tensor(body["values"], dtype=dtype_of(body["dtype"]))
            return flat.reshape(body["shape"])
        if tag == "$dtype":
            return dtype_of(body)
        if tag == "$device":
            return torch.device(body)
        if tag == "$tuple":
            return tuple(decode(v, tensors) for v in body)
        if tag == "$dict":
            return {decode(k, tensors): decode(v, tensors) for k, v in body}
        if tag == "$set":
            return {decode(v, tensors) for v in body}
    return {k: decode(v, tensors) for k, v in data.items()}


def save_tree(path: str | os.PathLike[str], value: Any, *, where: str = "value") -> Path:
    """Write `value` to the safetensors file `path` (tensors as data, the rest as JSON)."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = encode(value, tensors, where=where)
    stored: dict[str, torch.Tensor] = {}
    storages: set[tuple[str, int]] = set()
    for key, tensor in tensors.items():
        t = tensor.detach()
        if t.layout != torch.strided:
            raise TreeEncodeError(f"{where} holds a {t.layout} tensor; only dense tensors can "
                                  "be stored")
        t = t.cpu().contiguous()
        storage = (str(t.device), t.untyped_storage().data_ptr())
        if storage in storages and t.numel():  # safetensors refuses tensors sharing memory
            t = t.clone()
        storages.add(storage)
        stored[key] = t
    out = Path(path)
    save_file(stored, str(out), metadata={_KEY: json.dumps(skeleton)})
    return out


def load_tree(path: str | os.PathLike[str]) -> Any:
    """The value `save_tree` wrote to `path` (read by `read_tree`, the one reader);
    `DamagedFileError` (naming the file) when the file is truncated, altered or not such a file.
    Missing files raise FileNotFoundError. Nothing checks the bytes against a manifest here:
    files pdcompile loads for use are read by runtime/verified_read.py."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(2, "No such file", str(file))
    with open(file, "rb") as handle:
        return read_tree(handle, os.fstat(handle.fileno()).st_size, file, seen=_ignore)


def load_skeleton(path: str | os.PathLike[str]) -> Any:
    """The JSON part of the tree file `path` (`tree_skeleton`), read by `read_tensors` as
    `load_tree` reads it, its tensors' bytes read but not kept; DamagedFileError as there."""
    with open(path, "rb") as handle:
        metadata, _ = read_tensors(handle, os.fstat(handle.fileno()).st_size, path,
                                   seen=_ignore, tree=True, keep=False)
    return tree_skeleton(metadata, path)


def _ignore(_: memoryview) -> None:
    """A `seen` that keeps nothing (a read that checks no hash)."""


def read_tree(handle: BinaryIO, size: int, name: str | os.PathLike[str], *,
              seen: Callable[[memoryview], object]) -> Any:
    """The value `save_tree` wrote, read from `handle` (a file of `size` bytes) front to back,
    once: every byte read is passed to `seen` (e.g. a hash's update) and is the byte that ends
    up in the value, each tensor's straight into its own memory. `name` names the file in
    errors (DamagedFileError). The caller checks what `seen` saw before it uses the value."""
    metadata, tensors = read_tensors(handle, size, name, seen=seen, tree=True)
    return tree_value(metadata, tensors, name)


def tree_value(metadata: dict[str, Any], tensors: dict[str, torch.Tensor],
               name: str | os.PathLike[str]) -> Any:
    """The tree of a file `read_tensors` read (its metadata and tensors); DamagedFileError
    naming the file when the metadata holds none or a malformed one."""
    skeleton = tree_skeleton(metadata, name)
    try:
        return decode(skeleton, tensors)
    except (ValueError, KeyError, TypeError, RuntimeError, RecursionError) as err:
        raise _damaged(name, err) from None


def read_tensors(handle: BinaryIO, size: int, name: str | os.PathLike[str], *,
                 seen: Callable[[memoryview], object], tree: bool = False, keep: bool = True
                 ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A safetensors file's metadata and tensors, read from `handle` as `read_tree` reads
    (once, front to back, every byte shown to `seen`). `tree`: refuse a file without a tree
    before its tensors are read. `keep=False`: the tensors' bytes are read and shown to `seen`
    the same way, through one reused buffer, and dropped, the tensors returned as meta tensors
    (their shapes and dtypes alone: a check that loads nothing holds no copy of the weights).
    The caller checks what `seen` saw before it uses them."""
    try:
        head = read_bytes(handle, 8, seen)
        header_size = int.from_bytes(head, "little")
        if header_size > min(size - 8, _MAX_HEADER):
            raise ValueError(f"a header of {header_size:,} bytes in a file of {size:,}")
        header = json.loads(read_bytes(handle, header_size, seen))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
        metadata = header.pop("__metadata__", None)
        if metadata is None and not tree:
            metadata = {}
        if not isinstance(metadata, dict) or (tree and _KEY not in metadata):
            raise ValueError("it holds no pdcompile data")
        tensors = {}
        spans = _layout(header, size - 8 - header_size)
        if not keep:
            _skip(handle, sum(span[3] for span in spans), seen)
            return metadata, {key: torch.empty(shape, dtype=dtype, device="meta")
                              for key, dtype, shape, _ in spans}
        for key, dtype, shape, nbytes in spans:
            raw = torch.empty(nbytes, dtype=torch.uint8)
            if nbytes:
                _read_into(handle, memoryview(raw.numpy()), seen)
            tensors[key] = raw.view(dtype).reshape(shape) if nbytes else torch.empty(
                shape, dtype=dtype)
        return metadata, tensors
    except (ValueError, KeyError, TypeError, RuntimeError, RecursionError) as err:
        raise _damaged(name, err) from None


def tree_skeleton(metadata: dict[str, Any], name: str | os.PathLike[str]) -> Any:
    """The JSON part of a tree file `read_tensors` read (its tensors left as the references
    the JSON holds: what a check reads of a file it does not load); DamagedFileError naming
    the file when the metadata holds none or no valid JSON."""
    try:
        if _KEY not in metadata:
            raise ValueError("it holds no pdcompile data")
        return json.loads(metadata[_KEY])
    except (ValueError, TypeError, RecursionError) as err:
        raise _damaged(name, err) from None


def _damaged(name: str | os.PathLike[str], err: BaseException) -> DamagedFileError:
    detail = str(err).splitlines()[0] if str(err) else type(err).__name__
    return DamagedFileError(f"{name} is truncated, altered or not a file pdcompile wrote "
                            f"({detail}); write it again")


# safetensors' names of the dtypes save_tree can write
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64}
_MAX_HEADER = 100_000_000  # safetensors' own limit
_CHUNK = 1 << 20


def _layout(header: dict[str, Any], payload: int
            ) -> list[tuple[str, torch.dtype, list[int], int]]:
    """The tensors a safetensors header describes, in file order: key, dtype, shape, bytes.
    Their byte ranges must tile the `payload` bytes after the header exactly, as safetensors
    requires (so that nothing is allocated beyond the file's size)."""
    spans = []
    for key, info in header.items():
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {key!r} has dtype {_shown(info['dtype'])}, which pdcompile "
                             "does not write")
        shape, offsets = list(info["shape"]), list(info["data_offsets"])
        if not all(type(n) is int for n in [*shape, *offsets]):  # not 2.5, "2" or true
            raise ValueError(f"tensor {key!r} has a shape or offsets that are not integers")
        begin, end = offsets
        count = 1
        for n in shape:
            if n < 0:
                raise ValueError(f"tensor {key!r} has a negative size")
            count *= n
        if end - begin != count * dtype.itemsize:
            raise ValueError(f"tensor {key!r} spans bytes {begin}-{end}, not its shape's")
        spans.append((begin, end, key, dtype, shape))
    position = 0
    for begin, end, key, _, _ in sorted(spans, key=lambda s: s[:2]):
        if begin != position:
            raise ValueError(f"tensor {key!r} starts at byte {begin}, not {position}")
        position = end
    if position != payload:
        raise ValueError(f"its tensors end at byte {position} of {payload}")
    return [(key, dtype, shape, end - begin)
            for begin, end, key, dtype, shape in sorted(spans, key=lambda s: s[:2])]


def _shown(value: Any) -> str:
    """A value of a header for a message, cut short."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def read_bytes(handle: BinaryIO, count: int, seen: Callable[[memoryview], object]) -> bytes:
    """The next `count` bytes of `handle`, each chunk shown to `seen` as it lands (ValueError
    when the file ends first)."""
    out = bytearray(count)
    _read_into(handle, memoryview(out), seen)
    return bytes(out)


def _skip(handle: BinaryIO, count: int, seen: Callable[[memoryview], object]) -> None:
    """Read the next `count` bytes of `handle` through one buffer of at most a chunk, each
    chunk shown to `seen` as it lands, none kept (ValueError when the file ends first)."""
    buffer = memoryview(bytearray(min(count, _CHUNK)))
    while count:
        step = min(count, _CHUNK)
        _read_into(handle, buffer[:step], seen)
        count -= step


def _read_into(handle: BinaryIO, target: memoryview, seen: Callable[[memoryview], object]
               ) -> None:
    """Fill `target` from `handle`, chunk by chunk, each chunk shown to `seen` as it lands."""
    done = 0
    while done < len(target):
        got = handle.readinto(target[done:done + _CHUNK])
        if not got:
            raise ValueError(f"it ends {len(target) - done} bytes early")
        seen(target[done:done + got])
        done += got


__all__ = ["TreeEncodeError", "decode", "dtype_name", "dtype_of", "encode", "load_skeleton",
           "load_tree",
           "read_bytes", "read_tensors", "read_tree", "save_tree", "tree_skeleton", "tree_value"]
