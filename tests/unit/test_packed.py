"""comm.Packed: a bucket's uncompressed gradients leave as one flat tensor (one Horovod
request instead of one a tensor) and come back into the gradients as they are then,
values, shapes, strides and dtypes as if each had travelled alone."""

import torch

from horovod_powersgd.comm import Compression, Packed


class Doubling:
    """A wire that casts to `comm_dtype` (else sends as is) and an all-reduce that doubles."""

    compression = Compression.none

    def __init__(self, compression=None):
        self.wired = []
        if compression is not None:
            self.compression = compression

    def to_wire(self, grad, comm_dtype):
        self.wired.append(grad)
        return (grad if comm_dtype is None else grad.to(comm_dtype)), comm_dtype

    def from_wire(self, tensor, ctx):
        return tensor


def _reduced(packed):
    return [t * 2 for t in packed.tensors]


def test_one_flat_tensor_and_every_gradient_back_in_place():
    torch.manual_seed(0)
    grads = [
        torch.randn(7),
        torch.randn(3, 4, 2, 2).to(memory_format=torch.channels_last),  # not contiguous
        torch.randn(()),  # a scalar
        torch.randn(2, 3).t(),  # a transposed view
    ]
    inputs = [g.clone() for g in grads]
    packed = Packed(Doubling(), grads, None)
    assert len(packed.tensors) == 1 and packed.tensors[0].shape == (7 + 48 + 1 + 6,)
    out = packed.write(_reduced(packed), grads)
    for g, o, before in zip(grads, out, inputs):
        assert o is g
        assert torch.equal(g, before * 2)
    assert grads[1].is_contiguous(memory_format=torch.channels_last)


def test_the_wire_dtype_is_applied_once_and_cast_back():
    grads = [torch.randn(6), torch.randn(2, 3)]
    inputs = [g.clone() for g in grads]
    comm = Doubling()
    packed = Packed(comm, grads, torch.float16)
    assert len(comm.wired) == 1 and packed.tensors[0].dtype == torch.float16  # one cast
    packed.write(_reduced(packed), grads)
    for g, before in zip(grads, inputs):
        assert g.dtype == torch.float32
        assert torch.equal(g, (before.half() * 2).float())


def test_gradients_of_different_dtypes_each_travel_alone_in_place():
    grads = [torch.randn(3), torch.randn(4, dtype=torch.float64), torch.randn(2).half()]
    inputs = [g.clone() for g in grads]
    packed = Packed(Doubling(), grads, None)
    assert [t is g for t, g in zip(packed.tensors, grads)] == [True] * 3
    packed.write(_reduced(packed), grads)
    for g, before in zip(grads, inputs):
        assert torch.equal(g, before * 2)


def test_a_gradient_replaced_or_dropped_after_it_left_gets_the_aggregate():
    # Like Horovod's optimizer: the aggregate goes into p.grad as it is when it comes
    # back (code may have assigned a new tensor meanwhile); a None gets a tensor of its own.
    grads = [torch.ones(3), torch.ones(2, 2), torch.ones(4)]
    packed = Packed(Doubling(), grads, None)
    replaced = torch.zeros(2, 2)
    out = packed.write(_reduced(packed), [grads[0], replaced, None])
    assert out[1] is replaced and torch.equal(replaced, torch.full((2, 2), 2.0))
    assert torch.equal(out[2], torch.full((4,), 2.0))
    out[2].add_(1)  # its own storage, not a view of the wire buffer shared with the others
    assert torch.equal(out[0], torch.full((3,), 2.0))


def test_nothing_to_send_sends_nothing():
    packed = Packed(Doubling(), [], None)
    assert packed.tensors == []
    assert packed.write([], []) == []


class ScalePerTensor(Compression.none):
    """A user's compressor that looks at a tensor as a whole (a scale per tensor)."""


def test_a_users_own_compressor_gets_each_gradient_alone_as_in_horovod():
    grads = [torch.randn(3), torch.randn(4), torch.randn(2)]
    packed = Packed(Doubling(ScalePerTensor), grads, None)
    assert [t is g for t, g in zip(packed.tensors, grads)] == [True] * 3
    # Horovod's float16 acts element by element: it packs; a cast to the wire dtype too.
    assert len(Packed(Doubling(Compression.fp16), grads, None).tensors) == 1
    assert len(Packed(Doubling(ScalePerTensor), grads, torch.float16).tensors) == 1
