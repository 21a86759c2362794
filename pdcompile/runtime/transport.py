"""The contract between generated rank code and a backend: how tensors move between ranks.

Generated code never talks to torch.distributed or to mailboxes directly; it calls a Transport.
The local backend implements it with in-memory mailboxes (and the generated code yields while a
receive is not yet possible), the distributed backend with torch.distributed isend/irecv and
all-reduce over per-stage process groups.

A message is identified by its `Tag`: (kind, src_stage, dst_stage, microbatch, name). Shapes and
dtypes of every received tensor are known ahead (`TensorSpec`), so receives need no handshake.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import NamedTuple

import torch


class Tag(NamedTuple):
    """What a message carries: 'act' forward activations, 'grad' their gradients, 'target'.

    A named tuple, not a frozen dataclass: tags key the transports' dicts of posted receives
    and message shapes, and a dataclass's hash, equality and constructor are Python code
    (about 10 calls a message; docs/runtime-profile.md, eighth round), a tuple's are not."""

    kind: str
    src_stage: int
    dst_stage: int
    microbatch: int
    name: str = ""


class TensorSpec(NamedTuple):
    """Shape and dtype of a tensor that will arrive (from the shapes pass).

    A named tuple, as `Tag` is: a message's layout is cached by its specs
    (backends/packed_message.py) and the distributed transport matches the receives it
    expects by them, so they are hashed and compared for every message; a tuple does that in
    C (docs/runtime-profile.md, ninth round)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class Pending(abc.ABC):
    """A started operation; `ready()` says whether `wait()` would return without blocking."""

    @abc.abstractmethod
    def ready(self) -> bool:
        """True when `wait()` will not block."""

    @abc.abstractmethod
    def wait(self) -> list[torch.Tensor]:
        """Block until done; returns the received tensors (empty for a send)."""


class Transport(abc.ABC):
    """Point-to-point and group communication for one rank."""

    rank: int

    @abc.abstractmethod
    def send(self, tensors: Sequence[torch.Tensor], dst_rank: int, tag: Tag) -> Pending:
        """Start sending `tensors` to `dst_rank`; the caller must not modify them until done."""

    @abc.abstractmethod
    def recv(self, specs: Sequence[TensorSpec], src_rank: int, tag: Tag) -> Pending:
        """Start receiving tensors of the given specs from `src_rank`."""

    @abc.abstractmethod
    def all_reduce(self, tensors: Sequence[torch.Tensor], ranks: Sequence[int]) -> Pending:
        """Start summing `tensors` in place over `ranks` (which include this rank)."""
