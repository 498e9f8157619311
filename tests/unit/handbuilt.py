"""IR built by hand, for the unit tests below the face.

As torch.fx's own tests build graphs node by node and run one pass on them,
these helpers build ``Graph``s op by op (real ATen overloads, their cost
classes from ``ir.ops.cost_class``) and wrap them in a ``Program``, so that a
pass, a cost rule or the engine can be tested alone: no module, no capture,
no compiler.

* ``Builder``: one graph, op by op; result shapes come from running the ATen
  overload on meta tensors.
* ``mlp_step``: a training step (or inference forward) of ``relu(x @ w)``
  layers, with its hand-written backward for the loss ``0.5 * sum(out**2)``;
  blocks as capture leaves them (``op.block = (user_id, ipu)``).
* ``sgd_update``: SGD with momentum over the step's parameters, in the
  engine's input order (params, gradients, state, hyper, grad_scale).
* ``training_program`` / ``inference_program``: the program around them,
  tile-mapped on a target, ready for ``passes.program.build_main``.
* ``device_state``: the ``state`` object the engine runs on
  (``runtime.state.weights.DeviceState``).
"""
import contextlib

import torch

from poptorchsim.estimate.targets import TEST_IPU
from poptorchsim.ir.graph import Graph, Op, Program, Repeat, Sequence
from poptorchsim.ir.ops import cost_class
from poptorchsim.passes.pipeline import input_ipus
from poptorchsim.passes.tile_mapping import map_graph
from poptorchsim.runtime.state.weights import DeviceState

aten = torch.ops.aten
F32 = torch.float32
MOMENTUM = 0.9


class Builder:
    """Builds one ``Graph`` op by op."""

    def __init__(self, name):
        self.graph = Graph(name)
        self._block = None
        self._backward = False

    def input(self, name, shape, role="input", dtype=F32):
        t = self.graph.new_tensor(name, shape, dtype, role)
        self.graph.inputs.append(t)
        return t

    def const(self, name, value):
        return self.graph.new_tensor(name, value.shape, value.dtype, "const", value=value)

    @contextlib.contextmanager
    def block(self, user_id, ipu):
        """Ops made inside are traced in block ``user_id`` on ``ipu``."""
        before, self._block = self._block, (user_id, ipu)
        try:
            yield
        finally:
            self._block = before

    @contextlib.contextmanager
    def backward(self):
        before, self._backward = self._backward, True
        try:
            yield
        finally:
            self._backward = before

    def op(self, target, *args, name=None, **kwargs):
        """One op of ATen overload ``target``; returns its result tensor."""
        g = self.graph

        def meta(x):
            if hasattr(x, "producer"):          # an IR Tensor
                return torch.empty(x.shape, dtype=x.dtype, device="meta")
            return x
        result = target(*[meta(a) for a in args], **kwargs)
        name = name or f"{target.overloadpacket.__name__}_{len(g.ops)}"
        op = Op(len(g.ops), name, target, args, kwargs, [], cost_class(target),
                block=self._block, backward=self._backward)
        out = g.new_tensor(name, result.shape, result.dtype, producer=op)
        op.outputs.append(out)
        g.ops.append(op)
        return out

    def finish(self, outputs):
        self.graph.outputs = list(outputs)
        return self.graph


def mlp_step(n_layers=1, width=4, batch=2, ipus=None, training=True, name=None):
    """``out = relu(...relu(x @ w0)... @ w{n-1})``; in training also the
    gradients of ``0.5 * sum(out**2)``: outputs ``[out, grad w0, ...]``.
    ``ipus``: the IPU of each layer's block (block user id = layer index);
    None: no blocks."""
    b = Builder(name or ("training_step" if training else "inference_forward"))
    ws = [b.input(f"w{k}", (width, width), "param") for k in range(n_layers)]
    x = b.input("x", (batch, width), "input")
    hs = [x]

    def in_block(k):
        return b.block(k, ipus[k]) if ipus is not None else contextlib.nullcontext()
    for k, w in enumerate(ws):
        with in_block(k):
            z = b.op(aten.mm.default, hs[-1], w, name=f"layer{k}/mm")
            hs.append(b.op(aten.relu.default, z, name=f"layer{k}/relu"))
    if not training:
        return b.finish([hs[-1]])
    grads = [None] * n_layers
    dh = hs[-1]                               # d(0.5 * sum(out**2)) / d out
    with b.backward():
        for k in reversed(range(n_layers)):
            with in_block(k):
                dz = b.op(aten.threshold_backward.default, dh, hs[k + 1], 0,
                          name=f"layer{k}/relu_backward")
                xt = b.op(aten.t.default, hs[k], name=f"layer{k}/t_in")
                grads[k] = b.op(aten.mm.default, xt, dz, name=f"layer{k}/grad")
                if k:
                    wt = b.op(aten.t.default, ws[k], name=f"layer{k}/t_w")
                    dh = b.op(aten.mm.default, dz, wt, name=f"layer{k}/grad_in")
    return b.finish([hs[-1]] + grads)


def sgd_update(step):
    """SGD with momentum over ``step``'s parameters: ``v = 0.9 v + g *
    grad_scale; w = w - lr v``.  Inputs in the engine's order: params,
    gradients (``grad/<param>``), momenta (``momentum_buffer/<param>``), the
    learning rate, ``grad_scale``; outputs: new params then new momenta."""
    b = Builder("optimizer_update")
    params = [t for t in step.inputs if t.role == "param"]
    ws = [b.input(p.name, p.shape, "param") for p in params]
    gs = [b.input(f"grad/{p.name}", p.shape, "accumulator") for p in params]
    vs = [b.input(f"momentum_buffer/{p.name}", p.shape, "state") for p in params]
    lr = b.input("hyper/0/lr", (), "hyper")
    scale = b.input("grad_scale", (), "hyper")
    new_ws, new_vs = [], []
    for w, g, v in zip(ws, gs, vs):
        v2 = b.op(aten.add.Tensor, b.op(aten.mul.Tensor, v, MOMENTUM),
                  b.op(aten.mul.Tensor, g, scale))
        new_vs.append(v2)
        new_ws.append(b.op(aten.sub.Tensor, w, b.op(aten.mul.Tensor, v2, lr)))
    graph = b.finish(new_ws + new_vs)
    graph.outputs_overwrite_inputs = True
    return graph


def reference_sgd(w, g, v, lr, grad_scale):
    """``sgd_update``'s arithmetic in plain PyTorch: (new w, new v)."""
    v2 = v * MOMENTUM + g * grad_scale
    return w - v2 * lr, v2


def map_tiles(program, target=TEST_IPU):
    """Every tensor of every graph on tiles, the device variables recorded
    (as the compiler's tile-mapping step does)."""
    variables, cursor = {}, None
    for graph in program.graphs.values():
        cursor = map_graph(graph, target, cursor, variables, input_ipus(graph))
    program.variables = variables
    return program


def _streams(program, x, out):
    di, ga, rf = program.device_iterations, program.accumulation, program.replicas
    copies = di * ga * rf
    program.in_bytes, program.out_bytes = x.nbytes * copies, out.nbytes * copies
    program.in_streams = [("no_overlap", copies, program.in_bytes)]
    program.out_streams = [("no_overlap", di, program.out_bytes)]
    return program


def training_program(di=1, ga=1, rf=1, n_layers=1, width=4, batch=2, processes=1,
                     locations=None, sharded_state=(), synthetic=False, target=TEST_IPU,
                     step=None):
    """A training program (model graph not placed: one stage on IPU 0),
    tile-mapped on ``target`` (None: not mapped); ``main`` not yet built."""
    step = step or mlp_step(n_layers, width, batch)
    program = Program("training", {"training_step": step, "optimizer_update": sgd_update(step)},
                      replicas=rf, device_iterations=di, accumulation=ga,
                      synthetic_data=synthetic, processes=processes,
                      sharded_state=set(sharded_state))
    x = next(t for t in step.inputs if t.role == "input")
    _streams(program, x, step.outputs[0])
    if target is not None:
        map_tiles(program, target)
    program.locations = dict(locations or {})
    return program


def inference_program(di=1, rf=1, n_layers=1, width=4, batch=2, locations=None,
                      target=TEST_IPU):
    step = mlp_step(n_layers, width, batch, training=False)
    program = Program("inference", {"inference_forward": step}, replicas=rf,
                      device_iterations=di)
    _streams(program, step.inputs[-1], step.outputs[0])
    map_tiles(program, target)
    program.locations = dict(locations or {})
    return program


def device_state(params, rf=1, momenta=None, lr=0.1, grad_scale=1.0):
    """The engine's ``state`` for ``sgd_update``: params, no buffers, one
    momentum slot per parameter, no step counters, hyper = [lr]."""
    st = DeviceState()
    st.params = [p.clone() for p in params]
    st.buffers = [[] for _ in range(rf)]
    st.n_trainable = len(params)
    st.opt_state = [[torch.zeros_like(p) if momenta is None else momenta[k].clone()]
                    for k, p in enumerate(params)]
    st.steps = []
    st.hyper = [torch.tensor(lr)]
    st.grad_scale = torch.tensor(grad_scale)
    return st


def walk(step, times=1):
    """Every step of a control program with the times it runs per call
    (the product of the counts of the loops around it), depth first."""
    yield step, times
    if isinstance(step, Sequence):
        for s in step.steps:
            yield from walk(s, times)
    elif isinstance(step, Repeat):
        yield from walk(step.body, times * step.count)


def kinds(step):
    """The control program as nested lists of step class names:
    ``Repeat`` as ``("Repeat", counter, count, [body])``."""
    if isinstance(step, Sequence):
        return [k for s in step.steps for k in _flat(kinds(s))]
    if isinstance(step, Repeat):
        return ("Repeat", step.counter, step.count, _flat(kinds(step.body)))
    return type(step).__name__


def _flat(k):
    return k if isinstance(k, list) else [k]
