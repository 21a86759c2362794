"""A message's tensors packed into one buffer read back as they were sent, whatever their
shapes and dtypes (the receiver's views of the buffer), and only several small tensors pack."""

from __future__ import annotations

import sys

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcompile.backends.packed_message import PACK_LIMIT, pack, packs, spec_of, unpack
from pdcompile.runtime.transport import TensorSpec

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int8, torch.uint8, torch.bool, torch.complex64]


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 100, shape, generator=gen)
    return raw.to(dtype) if dtype is not torch.bool else raw % 2 == 0


tensors = st.lists(st.tuples(st.lists(st.integers(0, 5), max_size=3).map(tuple),
                             st.sampled_from(DTYPES), st.integers(0, 2**16)),
                   min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(tensors)
def test_unpack_reads_back_what_pack_packed(drawn: list[tuple[tuple[int, ...], torch.dtype,
                                                                int]]) -> None:
    sent = [_tensor(shape, dtype, seed) for shape, dtype, seed in drawn]
    specs = [spec_of(t) for t in sent]
    buffer = pack(sent)
    assert buffer.dtype is torch.uint8 and buffer.dim() == 1
    got = unpack(buffer.clone(), specs)  # the receiver's buffer, filled by the transfer
    for before, after in zip(sent, got, strict=True):
        assert after.dtype is before.dtype and after.shape == before.shape
        assert torch.equal(after, before)


def test_a_received_view_takes_part_in_autograd_like_a_tensor_of_its_own() -> None:
    sent = [torch.randn(4, 3), torch.tensor([1, 2, 0, 1])]
    x, target = unpack(pack(sent), [spec_of(t) for t in sent])
    x = x.clone().requires_grad_()  # as the stage runtime takes a received activation
    torch.nn.functional.cross_entropy(x, target).backward()
    assert x.grad is not None and x.grad.shape == (4, 3)


def test_only_several_tensors_within_the_limit_pack() -> None:
    small = TensorSpec((32, 1024), torch.float32)
    assert not packs([small])  # one tensor is one transfer already: no copy
    assert packs([small, TensorSpec((32,), torch.int64)])
    assert not packs([TensorSpec((PACK_LIMIT // 4,), torch.float32), TensorSpec((), torch.int64)])


@settings(max_examples=20, deadline=None)
@given(shape=st.lists(st.integers(0, 64), max_size=3), dtype=st.sampled_from(DTYPES))
def test_a_spec_hashes_and_compares_without_python_code(shape: list[int],
                                                        dtype: torch.dtype) -> None:
    """Every message looks its layout up by its specs (and the transport matches expected
    receives by them): their hash and equality run no Python function, as a tuple's do."""
    spec, same = TensorSpec(tuple(shape), dtype), spec_of(torch.empty(shape, dtype=dtype))
    called: list[str] = []

    def profile(frame: object, event: str, arg: object) -> None:
        if event == "call":
            called.append(frame.f_code.co_name)  # type: ignore[attr-defined]

    sys.setprofile(profile)
    try:
        equal, hashes = spec == same, hash(spec) == hash(same)
    finally:
        sys.setprofile(None)
    assert equal and hashes
    assert called == [], f"Python code ran to hash or compare specs: {called}"
