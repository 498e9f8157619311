"""The gradient watch's compiled counts (``machine/watch_kernel.py``) give
the PyTorch form's counts exactly, and its magnitudes to fp32 summation
order, on results that stress them: zeros of both signs, values that
underflow in fp16, subnormals, values past fp16's largest, infinities and
NaNs, fp16 results and their values held in fp32 (wide values); and the
watch, counting a batched call, compares the first micro-batch alone."""
import pytest
import torch

from poptorchsim.machine import gradient_watch, watch_kernel
from poptorchsim.machine.gradient_watch import GradientWatch


def _wide(n, seed, special):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 12, (n,), generator=g)
                                                  .float())
    x[::7] = 0.0
    x[3::11] = -0.0
    if special == "overflow":
        x[5::97] = 70000.0          # finite in fp32, infinite in fp16
    if special == "inf":
        x[9::101] = -float("inf")
    if special == "nan":
        x[13::103] = float("nan")
    return x


def _counted(monkeypatch, compiled, out, wide, stochastic=False):
    if not compiled:
        monkeypatch.setattr(gradient_watch.watch_kernel, "counts", lambda o, w: None)
    w = GradientWatch()
    w._count_rounded("op", out, wide, stochastic)
    monkeypatch.undo()
    return w


@pytest.mark.parametrize("n", [1, 63, 4096, 131_073])
@pytest.mark.parametrize("special", [None, "overflow", "inf", "nan"])
@pytest.mark.parametrize("held", ["fp16", "fp32"])
def test_compiled_counts_equal_the_pytorch_forms(monkeypatch, n, special, held):
    if watch_kernel.njit is None or not watch_kernel.sr_kernel.available():
        pytest.skip("numba is not installed")
    wide = _wide(n, n, special)
    out = wide.half()
    if held == "fp32":
        out = out.float()
    assert watch_kernel.counts(out, wide) is not None        # the compiled form applies
    a = _counted(monkeypatch, False, out, wide)
    b = _counted(monkeypatch, True, out, wide)
    assert (a.values, a.nonzero, a.underflowed, a.overflowed, a.nonfinite) == \
        (b.values, b.nonzero, b.underflowed, b.overflowed, b.nonfinite)
    ra, rb = a.per_op["op"], b.per_op["op"]
    assert ra[:3] == rb[:3]
    assert rb[3] == pytest.approx(ra[3], rel=1e-5) and rb[4] == pytest.approx(ra[4], rel=1e-5)
    if not special and n > 1:
        assert a.underflowed > 0            # the case exercises the magnitudes


def test_the_pytorch_form_runs_where_the_compiled_one_does_not_apply():
    wide = _wide(64, 0, None)
    assert watch_kernel.counts(wide.half(), wide.double()) is None      # an fp64 reference
    assert watch_kernel.counts(wide.half()[:32], wide) is None          # shapes differ


def test_a_counted_half_partials_op_compares_its_first_micro_batch_alone():
    """A half-partials op the watch counts, in a batched call (vmapped over
    three micro-batches): it returns its kernel's results for every
    micro-batch and counts the first one's against that micro-batch's fp32
    product, value by value, made for it alone."""
    from poptorchsim.ir.graph import Op, Tensor
    from poptorchsim.machine.half_partials import half_partials_kernel
    aten = torch.ops.aten
    g = torch.Generator().manual_seed(0)
    # rows of products whose fp16 partial sums underflow, rows of ordinary ones
    a = (torch.randn(3, 8, 300, generator=g)
         * torch.exp2(torch.randint(-24, 4, (3, 8, 1), generator=g).float())).half()
    b = (torch.randn(300, 5, generator=g) * 2.0 ** -12).half()
    ins = (Tensor(0, "a", (8, 300), torch.float16), Tensor(1, "b", (300, 5), torch.float16))
    op = Op(0, "mm", aten.mm.default, ins, {}, [Tensor(2, "mm", (8, 5), torch.float16)],
            "matmul", partials="half")
    kernel = half_partials_kernel(aten.mm.default)
    watch = GradientWatch()
    out = torch.func.vmap(watch.wrap(op, kernel, aten.mm.default), in_dims=(0, None))(a, b)
    assert torch.equal(out, torch.stack([kernel(x, b) for x in a]))
    alone = GradientWatch()
    alone._count_values("mm", kernel(a[0], b), a[0].float() @ b.float())
    assert watch.per_op == alone.per_op and watch.values == 40
    assert watch.underflowed > 0


def test_a_counted_op_that_rounds_like_fp32_runs_its_kernel_and_counts_its_first_row():
    """An op whose fp16 kernel gives the rounded fp32 values (a product,
    rounding to nearest), counted in a batched call: it returns its kernel's
    results (the values a call not counted gives) and counts the first
    micro-batch against its fp32 product, made for it alone."""
    from poptorchsim.ir.graph import Op, Tensor
    aten = torch.ops.aten
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(3, 64, generator=g) * 2.0 ** -12).half()
    b = (torch.randn(3, 64, generator=g) * 2.0 ** -12).half()     # products underflow
    ins = (Tensor(0, "a", (64,), torch.float16), Tensor(1, "b", (64,), torch.float16))
    op = Op(0, "mul", aten.mul.Tensor, ins, {}, [Tensor(2, "mul", (64,), torch.float16)],
            "elementwise")
    kernel = aten.mul.Tensor
    watch = GradientWatch()
    out = torch.func.vmap(watch.wrap(op, kernel, kernel))(a, b)
    assert torch.equal(out, a * b)
    alone = GradientWatch()
    alone._count_rounded("mul", a[0] * b[0], a[0].float() * b[0].float())
    assert watch.per_op == alone.per_op and watch.values == 64 and watch.underflowed > 0
