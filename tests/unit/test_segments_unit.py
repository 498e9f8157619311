"""``machine/segments.py`` on graphs built by hand: copies of one rule
(``Op.rule_copy``) run as calls of shared functions, with the results of
one line per op; what a copy makes and a later one reads is returned; the
constants the shared functions take are placed on the host device."""
import pytest
import torch
from handbuilt import Builder

from poptorchsim.machine import host_device, segments
from poptorchsim.machine.codegen import compile_graph

aten = torch.ops.aten


def _copies(n=3, width=5, shared_scale=True):
    """``n`` copies of one rule over inputs x0.. (a factory op with a
    device, then element-wise work); with ``shared_scale`` the first copy
    makes a scalar every later copy reads (as the update's merged
    hyperparameter arithmetic is made once, by the first copy)."""
    b = Builder("optimizer_update")
    xs = [b.input(f"x{i}", (width,), "param") for i in range(n)]
    outs, scale = [], None
    for i, x in enumerate(xs):
        first = len(b.graph.ops)
        full = b.op(aten.full.default, [width], 2.0, dtype=torch.float32,
                    device=torch.device("cpu"))
        if scale is None or not shared_scale:
            scale = b.op(aten.mul.Tensor, b.op(aten.sum.default, full), 0.25)
        y = b.op(aten.mul.Tensor, x, full)
        y = b.op(aten.add.Tensor, y, scale)
        y = b.op(aten.sqrt.default, b.op(aten.abs.default, y))
        y = b.op(aten.sub.Tensor, y, x)
        y = b.op(aten.mul.Tensor, b.op(aten.exp.default, y), scale)
        outs.append(b.op(aten.add.Tensor, y, 1.0))
        for op in b.graph.ops[first:]:
            op.rule_copy = i
    return b.finish(outs)


@pytest.mark.parametrize("shared_scale", [True, False])
def test_copies_share_functions_and_give_the_values_of_one_line_per_op(monkeypatch,
                                                                      shared_scale):
    graph = _copies(shared_scale=shared_scale)
    inputs = [torch.randn(5, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    shared = compile_graph(graph)
    # the first copy returns the scale the others read: its text differs from theirs
    assert shared.source.count("\ndef _s") == (2 if shared_scale else 1)
    monkeypatch.setattr(segments, "MIN_OPS", 10 ** 9)
    flat = compile_graph(graph)
    assert "def _s" not in flat.source
    for a, b in zip(shared(list(inputs)), flat(list(inputs))):
        assert torch.equal(a, b)


def test_shared_functions_take_constants_placed_on_the_host_device(monkeypatch):
    """The copies' factory op holds a traced device: compiled for a CUDA host
    device (fake CUDA tensors, which check devices as CUDA would), the
    shared functions' constants are CUDA's."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    graph = _copies()
    cuda = torch.device("cuda")
    monkeypatch.setattr(host_device, "current", lambda: cuda)
    fn = compile_graph(graph)
    assert "\ndef _s" in fn.source
    with FakeTensorMode(allow_non_fake_inputs=True):
        outs = fn([torch.empty(5, device=cuda) for _ in range(3)])
    assert {o.device.type for o in outs} == {"cuda"}
