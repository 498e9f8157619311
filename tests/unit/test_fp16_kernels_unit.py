"""The fp16 kernels the gradient watch runs natively between counted
micro-batches must give the fp32 kernel's result rounded to nearest fp16,
bit for bit (``machine/precision.py`` ``ROUNDS_LIKE_FP32``): a counted
micro-batch computes them that way, and every micro-batch must compute the
same values.  Checked on this machine's PyTorch, over values that stress
the rounding: subnormals, values near fp16's largest, zeros of both signs."""
import pytest
import torch

from poptorchsim.machine.precision import ROUNDS_LIKE_FP32

aten = torch.ops.aten


def _values(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-26, 16, shape, generator=g)
                                                      .float())
    x.view(-1)[::7] = 0.0
    x.view(-1)[3::11] = -0.0
    return x.clamp(-65504, 65504).half()


def _h(*shape, seed=0):
    return _values(shape, seed)


CASES = {
    aten.add.Tensor: lambda: (_h(64, 33), _h(64, 33, seed=1)),
    aten.sub.Tensor: lambda: (_h(64, 33), _h(33, seed=1)),
    aten.mul.Tensor: lambda: (_h(64, 33), _h(64, 33, seed=1)),
    aten.mul.Scalar: lambda: (_h(64, 33), 0.125),
    aten.div.Tensor: lambda: (_h(64, 33), _h(64, 33, seed=1).abs() + 1),
    aten.div.Scalar: lambda: (_h(64, 33), 3.0),
    aten.neg.default: lambda: (_h(64, 33),),
    aten.where.self: lambda: (_h(64, 33) > 0, _h(64, 33, seed=1), _h(64, 33, seed=2)),
    aten.threshold_backward.default: lambda: (_h(64, 33), _h(64, 33, seed=1), 0),
    aten.tanh_backward.default: lambda: (_h(64, 33), torch.rand(64, 33).half()),
    aten.clone.default: lambda: (_h(64, 33),),
    aten.cat.default: lambda: ([_h(8, 33), _h(5, 33, seed=1)],),
    aten._to_copy.default: lambda: (torch.randn(64, 33) * 1e-6,),
}


def _rounded(target, args):
    wide = [a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.half else
            [b.float() for b in a] if isinstance(a, list) else a for a in args]
    kwargs = {"dtype": torch.float16} if target is aten._to_copy.default else {}
    return target(*wide, **({"dtype": torch.float32} if kwargs else {})).half(), kwargs


@pytest.mark.parametrize("target", sorted(ROUNDS_LIKE_FP32, key=str), ids=str)
def test_native_fp16_kernel_equals_fp32_rounded(target):
    assert target in CASES, f"{target} has no case: add one to trust it"
    args = CASES[target]()
    expected, kwargs = _rounded(target, args)
    native = target(*args, **kwargs)
    assert native.dtype == torch.float16
    assert torch.equal(native.view(torch.int16), expected.view(torch.int16))
