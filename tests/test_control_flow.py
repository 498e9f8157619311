"""``poptorchsim.for_loop`` and ``poptorchsim.cond``: IR ops holding their
bodies as sub-graphs, run on the device, costed as a loop and a branch."""
import pytest
import torch
import torch.nn.functional as F
from conftest import quiet_options
from torch import nn

import poptorchsim


class Looped(nn.Module):
    """A linear layer applied ``count`` times in an on-device loop."""

    def __init__(self, count=3, width=8):
        super().__init__()
        self.count = count
        self.fc = nn.Linear(width, width)

    def forward(self, x, scale):
        def body(h, k):
            return torch.tanh(self.fc(h)) * scale, k + 1
        h, k = poptorchsim.for_loop(self.count, body, [x, torch.zeros_like(scale)])
        return h, k


class Branching(nn.Module):
    """A branch chosen on the device by the sign of a sum."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x, flag):
        return poptorchsim.cond(flag.sum() > 0,
                                lambda h: [F.relu(self.a(h)), h.sum(1)], [x],
                                lambda h: [self.b(h) - x, x.mean(1)], [x])


def compiled(model, *inputs):
    sim = poptorchsim.inferenceModel(model, quiet_options())
    return sim, sim(*inputs)


def control_op(sim):
    graph = sim.getIR().graphs["inference_forward"]
    return next(op for op in graph.ops if op.subgraphs)


def test_loop_matches_python_loop():
    torch.manual_seed(0)
    model = Looped(count=4)
    x, scale = torch.randn(3, 8), torch.rand(1) + 0.5
    sim, (h, k) = compiled(model, x, scale)
    want = x
    for _ in range(4):
        want = torch.tanh(model.fc(want)) * scale
    torch.testing.assert_close(h, want.detach())
    assert k.item() == 4
    # the same model outside the IPU runs the loop in Python
    torch.testing.assert_close(model(x, scale)[0], want)


def test_loop_is_one_ir_op_holding_its_body():
    sim, _ = compiled(Looped(count=5), torch.randn(2, 8), torch.ones(1))
    op = control_op(sim)
    assert op.cost_class == "loop" and op.attrs == {"count": 5}
    body = op.subgraphs["body"]
    assert any(str(inner.target) == "aten.addmm.default" for inner in body.ops)
    # the body reads the weights as extra inputs, after the carried values
    assert [t.name for t in body.inputs][2:] == ["fc.weight", "fc.bias", "input1"]
    text = str(sim.getIR())
    assert "poptorchsim.for_loop(" in text and "count=5" in text
    assert "graph loop_begin_body(" in text


def test_loop_cycles_follow_the_count_and_memory_does_not():
    """The body is held once (code, vertex state) and run ``count`` times."""
    x, s = torch.randn(2, 8), torch.ones(1)
    torch.manual_seed(0)
    short, _ = compiled(Looped(count=2), x, s)
    torch.manual_seed(0)
    long, _ = compiled(Looped(count=8), x, s)
    loop = [control_op(m) for m in (short, long)]
    cost = [m._compiled.costs["inference_forward"][op.id].total for m, op in
            zip((short, long), loop)]
    assert cost[1] == pytest.approx(4 * cost[0], rel=1e-6)
    assert long.cycleEstimate()["total"] > short.cycleEstimate()["total"]
    always = [m.memoryReport().always_live.sum() for m in (short, long)]
    assert always[0] == always[1]

    class Unrolled(Looped):
        def forward(self, x, scale):
            h = x
            for _ in range(self.count):
                h = torch.tanh(self.fc(h)) * scale
            return h, torch.full_like(scale, self.count)
    torch.manual_seed(0)
    unrolled, _ = compiled(Unrolled(count=8), x, s)
    assert unrolled.memoryReport().always_live.sum() > always[1]


@pytest.mark.parametrize("flag", [1.0, -1.0])
def test_cond_takes_the_branch_the_device_chooses(flag):
    torch.manual_seed(0)
    model = Branching()
    x, f = torch.randn(4, 6), torch.tensor([flag])
    sim, got = compiled(model, x, f)
    with torch.no_grad():
        want = model(x, f)                     # outside tracing: Python chooses
    torch.testing.assert_close(got, want)
    # the compiled model chooses again at every call
    other = sim(x, -f)
    with torch.no_grad():
        torch.testing.assert_close(other, model(x, -f))


def test_cond_holds_both_branches_and_pays_the_longer():
    torch.manual_seed(0)
    sim, _ = compiled(Branching(), torch.randn(4, 6), torch.ones(1))
    op = control_op(sim)
    assert op.cost_class == "cond" and set(op.subgraphs) == {"then", "else"}
    cost = sim._compiled.costs["inference_forward"][op.id]
    branches = {name: sum(c.total for c in parts) for name, parts in cost.parts.items()}
    assert cost.total >= max(branches.values()) > 0
    assert cost.total < sum(branches.values()) + 2 * sim._compiled.target.sync_cycles
    # the else branch reads x and its layer's weights from the enclosing graph
    assert {t.name for t in op.subgraphs["else"].inputs} == {"input0", "b.weight", "b.bias"}


def test_loop_inside_a_branch():
    class Nested(nn.Module):
        def forward(self, x, flag):
            def twice(h):
                return poptorchsim.for_loop(2, lambda a: [a * 2], [h])
            return poptorchsim.cond(flag.sum() > 0, twice, [x], lambda h: [h - 1], [x])[0]
    x = torch.randn(5)
    sim, got = compiled(Nested(), x, torch.ones(1))
    torch.testing.assert_close(got, x * 4)
    torch.testing.assert_close(sim(x, -torch.ones(1)), x - 1)
    inner = control_op(sim).subgraphs["then"].ops
    assert [op.cost_class for op in inner if op.subgraphs] == ["loop"]


class TrainLoop(nn.Module):
    def __init__(self, use_cond=False):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.use_cond = use_cond

    def forward(self, x, target):
        if self.use_cond:
            out = poptorchsim.cond(x.sum() > 0, self.fc, [x], self.fc, [x])[0]
        else:
            out = poptorchsim.for_loop(2, self.fc, [x])[0]
        return out, F.mse_loss(out, target)


@pytest.mark.parametrize("use_cond,name", [(False, "for_loop"), (True, "cond")])
def test_training_is_refused_as_poptorch_does(use_cond, name):
    model = TrainLoop(use_cond)
    sim = poptorchsim.trainingModel(model, quiet_options(),
                                    torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorchsim.Error, match=rf"poptorch.{name}\(\) is only supported "
                                                 "in inference"):
        sim(torch.randn(2, 4), torch.randn(2, 4))


def test_bad_arguments_say_what_is_wrong():
    class Bad(nn.Module):
        def __init__(self, kind):
            super().__init__()
            self.kind = kind

        def forward(self, x):
            if self.kind == "not_list":
                return poptorchsim.for_loop(2, lambda a: a, x)
            if self.kind == "not_tensor":
                return poptorchsim.for_loop(2, lambda a, b: (a, b), [x, 5])
            if self.kind == "shape":
                return poptorchsim.for_loop(2, lambda a: a.sum(0), [x])
            if self.kind == "branches":
                return poptorchsim.cond(x.sum() > 0, lambda a: [a], [x],
                                        lambda a: [a, a], [x])
            return poptorchsim.cond(x.sum() > 0, lambda a: [a], x, lambda a: [a], [x])

    x = torch.randn(3, 2)
    cases = {"not_list": (ValueError, "Object is not list"),
             "not_tensor": (ValueError, "index 1 is not torch.tensor"),
             "shape": (poptorchsim.Error, "output 0 of the body is torch.float32"),
             "branches": (poptorchsim.Error, "same number of tensors"),
             "cond_not_list": (ValueError, "then_inps and else_inps")}
    for kind, (exc, text) in cases.items():
        with pytest.raises(exc, match=text):
            poptorchsim.inferenceModel(Bad(kind), quiet_options())(x)


def test_cond_estimate_pays_the_branches_the_device_took():
    """Before running, a conditional is estimated at its longer branch; after
    a call, ``cycleEstimate()`` pays the branches that call took."""
    class Uneven(nn.Module):
        def __init__(self):
            super().__init__()
            self.big = nn.Linear(64, 64)

        def forward(self, x, flag):
            heavy = lambda h: [self.big(self.big(self.big(h)))]    # noqa: E731 - a one-line helper
            return poptorchsim.cond(flag.sum() > 0, heavy, [x], lambda h: [h + 1], [x])[0]

    sim = poptorchsim.inferenceModel(Uneven(), quiet_options().deviceIterations(2))
    x = torch.randn(8, 64)
    sim.compile(x, torch.ones(2))
    compiled = sim.cycleEstimate()["total"]
    sim(x, torch.ones(2))                          # the heavy branch twice
    assert sim.cycleEstimate()["total"] == pytest.approx(compiled, rel=1e-9)
    sim(x, -torch.ones(2))                         # the light branch twice
    light = sim.cycleEstimate()["total"]
    assert light < compiled
    sim(x, torch.tensor([1.0, -1.0]))              # one of each
    half = sim.cycleEstimate()["total"]
    assert light < half < compiled
    assert half - light == pytest.approx((compiled - light) / 2, rel=1e-6)
