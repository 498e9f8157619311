"""Every ATen-reaching operator of PyTorch's OpInfo table, run on the
simulated IPU and compared with eager PyTorch.

PyTorch's own test database (``torch.testing._internal.common_methods_invocations
.op_db``, the table its operator tests are generated from) gives, for each
public operator, sample inputs.  ``check(opinfo)`` runs the first usable
float32 sample through ``inferenceModel`` (forward) and, for differentiable
operators, through ``trainingModel`` (backward: one SGD step with lr=1 on the
first input moves it by exactly minus its gradient).  The result is one of:

* ``"ok"``: forward (and backward) equal eager PyTorch;
* ``"rejected: <error class>"``: poptorchsim refused the program with its own
  typed error (data-dependent shapes, complex numbers, ...);
* ``"skipped: <why>"``: no usable sample;
* anything else is a failure, with its cause.

``python tests/op_sweep.py`` prints the outcome of every operator.
"""
import sys

import torch
import torch.utils._pytree as pytree

import poptorchsim

RTOL, ATOL = 1e-4, 1e-5


def op_db():
    from torch.testing._internal.common_methods_invocations import op_db as db
    return db


def _options():
    return poptorchsim.Options().showCompilationProgressBar(False)


def _usable(sample):
    leaves = pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    if not tensors or any(t.numel() == 0 for t in tensors):
        return None
    if any(t.layout != torch.strided or t.is_complex() for t in tensors):
        return None
    return leaves


class OpModule(torch.nn.Module):
    """``opinfo.op`` applied to a sample: tensor leaves are the model's
    inputs, everything else is fixed.  With ``param`` the first tensor is a
    parameter instead and forward returns the loss sum(output * weight)."""

    def __init__(self, opinfo, sample, param=None, weights=None):
        super().__init__()
        self.fn = opinfo.op
        leaves, self.spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
        self.is_tensor = [isinstance(t, torch.Tensor) for t in leaves]
        self.fixed = [None if t else v for t, v in zip(self.is_tensor, leaves)]
        self.param = None if param is None else torch.nn.Parameter(param)
        self.weights = weights

    def forward(self, *tensors):
        it = iter(tensors if self.param is None else (self.param,) + tensors)
        leaves = [next(it) if t else v for t, v in zip(self.is_tensor, self.fixed)]
        inp, args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        out = self.fn(inp, *args, **kwargs)
        if self.weights is None:
            return out
        outs = [o for o in pytree.tree_leaves(out)
                if isinstance(o, torch.Tensor) and o.is_floating_point()]
        loss = sum((o * w).sum() for o, w in zip(outs, self.weights))
        return poptorchsim.identity_loss(loss, reduction="none")


def _compare(got, want, exact=None):
    """``got`` equals eager's ``want``; where they differ by more than the
    tolerance, ``exact`` (eager in float64, when given) decides: the
    simulator must be no further from it than eager float32 is (twice that,
    plus the tolerance), as for ill-conditioned operators."""
    got_l, want_l = pytree.tree_leaves(got), pytree.tree_leaves(want)
    exact_l = pytree.tree_leaves(exact) if exact is not None else [None] * len(want_l)
    assert len(got_l) == len(want_l), f"{len(got_l)} outputs, eager has {len(want_l)}"
    for g, w, e in zip(got_l, want_l, exact_l):
        if not isinstance(w, torch.Tensor):
            assert g == w or (g != g and w != w), f"{g} != {w}"
            continue
        g = torch.as_tensor(g).to(w.dtype)
        try:
            torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL, equal_nan=True,
                                       check_device=False)
        except AssertionError:
            if not isinstance(e, torch.Tensor) or not w.is_floating_point() \
                    or g.shape != w.shape or e.shape != w.shape:
                raise
            e = e.to(torch.float64)
            sim_err, eager_err = _error(g, e), _error(w, e)
            assert bool((sim_err <= 2 * eager_err + ATOL + RTOL * e.abs()).all()), \
                f"further from float64 than eager float32: {float(sim_err.max()):.3g} " \
                f"vs {float(eager_err.max()):.3g}"


def _error(x, exact):
    """|x - exact|: 0 where both are NaN or the same infinity, inf where only
    one is NaN."""
    x = x.double()
    same = (x == exact) | (torch.isnan(x) & torch.isnan(exact))
    return torch.where(same, 0.0, (x - exact).abs()).nan_to_num(nan=float("inf"))


def _float64(module, tensors):
    """Eager ``module`` in float64 (None where the operator has no float64)."""
    import copy
    try:
        m = copy.deepcopy(module).double()
        m.weights = None if module.weights is None else [w.double() for w in module.weights]
        return m, [t.double() if t.is_floating_point() else t for t in tensors]
    except Exception:  # noqa: BLE001 - no float64 form: no reference
        return None, None


def _undefined(model):
    """Outputs of ``empty``-family ops hold whatever memory held."""
    graph = next(iter(model.getIR().graphs.values()))
    return any(t.producer is not None and
               t.producer.target.overloadpacket.__name__.lstrip("_").startswith(
                   ("empty", "new_empty"))
               for t in graph.outputs)


def _is_random(model):
    """Draws random numbers on the device (OpInfo reseeds eager's generator
    inside some ops, which a compiled program cannot do)."""
    graph = next(iter(model.getIR().graphs.values()))
    return any(op.cost_class == "random" for op in graph.ops)


def _sample(opinfo):
    for sample in opinfo.sample_inputs("cpu", torch.float32, requires_grad=False):
        leaves = _usable(sample)
        if leaves is not None:
            return sample, leaves
    return None, None


def check(opinfo):
    """The outcome of ``opinfo`` on the simulated IPU (see the module doc)."""
    if not opinfo.supports_dtype(torch.float32, "cpu"):
        return "skipped: no float32"
    sample, leaves = _sample(opinfo)
    if sample is None:
        return "skipped: no sample without empty or complex tensors"
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    module = OpModule(opinfo, sample)
    try:
        want = module(*tensors)
    except Exception as exc:    # noqa: BLE001 - eager itself rejects the sample
        return f"skipped: eager raises {type(exc).__name__}"
    if not any(isinstance(o, torch.Tensor) for o in pytree.tree_leaves(want)):
        return "skipped: no tensor output"
    model = poptorchsim.inferenceModel(module, _options())
    try:
        got = model(*tensors)
    except poptorchsim.Error as exc:
        return f"rejected: {type(exc).__name__}"
    if _is_random(model) or _undefined(model):
        got_l, want_l = pytree.tree_leaves(got), pytree.tree_leaves(want)
        assert [tuple(t.shape) for t in got_l] == [tuple(t.shape) for t in want_l]
        return "ok"
    m64, t64 = _float64(module, tensors)
    try:
        exact = m64(*t64) if m64 is not None else None
    except Exception:  # noqa: BLE001 - no float64 kernel
        exact = None
    _compare(got, want, exact)
    if opinfo.supports_autograd and tensors[0].is_floating_point():
        try:
            _check_backward(opinfo, sample, tensors, want)
        except poptorchsim.Error as exc:
            return f"rejected in training: {type(exc).__name__}"
    return "ok"


def _check_backward(opinfo, sample, tensors, want):
    """One SGD step (lr=1) on the first input equals minus eager's gradient."""
    outs = [o for o in pytree.tree_leaves(want)
            if isinstance(o, torch.Tensor) and o.is_floating_point()]
    if not outs:
        return
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o.shape, generator=g) for o in outs]
    first = tensors[0].detach().clone()
    ref = OpModule(opinfo, sample, first.clone(), weights)
    loss = ref(*tensors[1:])
    if not loss.requires_grad:
        return
    grad, = torch.autograd.grad(loss, ref.param, allow_unused=True)
    if grad is None:
        return
    model = OpModule(opinfo, sample, first.clone(), weights)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    poptorchsim.trainingModel(model, _options(), optimizer)(*tensors[1:])
    exact = None
    ref64, t64 = _float64(ref, tensors)
    if ref64 is not None:
        try:
            g64, = torch.autograd.grad(ref64(*t64[1:]), ref64.param, allow_unused=True)
            exact = first.double() - g64
        except Exception:  # noqa: BLE001 - no float64 kernel
            exact = None
    _compare(model.param.detach(), first - grad, exact)


if __name__ == "__main__":
    from tqdm import tqdm
    names = set(sys.argv[1:])
    counts = {}
    for info in tqdm([o for o in op_db() if not names or o.name in names]):
        try:
            outcome = check(info)
        except Exception as exc:  # noqa: BLE001 - reported
            outcome = f"FAIL {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        counts[outcome.split(":")[0]] = counts.get(outcome.split(":")[0], 0) + 1
        tqdm.write(f"{info.name}.{info.variant_test_name}: {outcome}")
    print(counts)
