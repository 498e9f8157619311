"""The fp16 kernels the gradient watch runs natively between counted
micro-batches must give the fp32 kernel's result rounded to nearest fp16,
bit for bit (``machine/precision.py`` ``ROUNDS_LIKE_FP32``): a counted
micro-batch computes them that way, and every micro-batch must compute the
same values.  Checked on this machine's PyTorch, over values that stress
the rounding: subnormals, values near fp16's largest, zeros of both signs."""
import pytest
import torch

from poptorchsim.machine.precision import (
    PARTIALS_CHUNK,
    ROUNDS_LIKE_FP32,
    SLICE_CHUNKS,
    half_partials_mm,
)

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


def _half_partials_by_the_book(a, b):
    """docs/precision.md's model, one step at a time: chunks of 16 products
    summed in fp32 and added to a running fp16 sum, slice by slice of
    ``SLICE_CHUNKS`` chunks; the slices' fp16 sums added pairwise as they
    come (two of the same height at once), the rest from the last."""
    a32, b32, k = a.float(), b.float(), a.shape[-1]
    width, sums = SLICE_CHUNKS * PARTIALS_CHUNK, []
    for i in range(0, k, width):
        acc = None
        for j in range(i, min(i + width, k), PARTIALS_CHUNK):
            end = min(j + PARTIALS_CHUNK, k)
            p = a32[..., j:end] @ b32[..., j:end, :]
            acc = p.half() if acc is None else (acc.float() + p).half()
        sums.append(acc)
    stack = []
    for p in sums:
        height = 0
        while stack and stack[-1][0] == height:
            p = (stack.pop()[1].float() + p.float()).half()
            height += 1
        stack.append((height, p))
    acc = stack.pop()[1]
    while stack:
        acc = (stack.pop()[1].float() + acc.float()).half()
    return acc


@pytest.mark.parametrize("shapes", [((8, 200), (200, 24)), ((20, 3000), (3000, 16)),
                                    ((2, 16, 700), (2, 700, 8)), ((5, 4096), (4096, 3)),
                                    # tall products beyond a cache's worth: rows in blocks
                                    ((3000, 40), (40, 100)), ((3, 3000, 40), (3, 40, 30))],
                         ids=str)
def test_half_partials_follow_the_documented_model(shapes):
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randn(s, generator=g).half() for s in shapes)
    assert torch.equal(half_partials_mm(a, b), _half_partials_by_the_book(a, b))


def test_half_partials_in_small_groups_give_the_same_tree(monkeypatch):
    """Slices computed a few at a time (a large matmul's running sums kept
    under the limit) are added in the same tree as all at once."""
    from poptorchsim.machine import half_partials
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(6, 7000, generator=g).half(), torch.randn(7000, 10, generator=g).half()
    whole = half_partials_mm(a, b)
    for limit in (60, 150):                     # 1 or 2 slices per group
        monkeypatch.setattr(half_partials, "_SUMS_LIMIT", limit)
        assert torch.equal(half_partials_mm(a, b), whole)
    assert torch.equal(whole, _half_partials_by_the_book(a, b))


def test_half_partials_of_an_empty_reduction_are_zeros():
    """A reduction over nothing gives fp16 zeros, as PyTorch's matmul does."""
    for a, b in (((3, 0), (0, 5)), ((2, 3, 0), (2, 0, 4))):
        out = half_partials_mm(torch.ones(a).half(), torch.ones(b).half())
        assert torch.equal(out, torch.ones(a).half() @ torch.ones(b).half())
        assert out.dtype == torch.float16


def test_half_partials_of_one_row_follow_its_operands_layout():
    """A product of one row (a class token through a ``Linear``: its weight
    transposed) is a matrix-vector product, whose kernel sums a chunk in an
    order its operands' layout sets: the chunks keep that layout, as the
    model's step-by-step products do."""
    g = torch.Generator().manual_seed(4)
    for _ in range(6):
        x, w = torch.randn(1, 768, generator=g).half(), torch.randn(768, 768, generator=g).half()
        for a, b in ((x, w.t()), (x, w), (w, x.t()), (w.t(), x.t())):
            assert torch.equal(half_partials_mm(a, b), _half_partials_by_the_book(a, b))


@pytest.mark.parametrize("shapes", [((40, 300), (300, 9)), ((3, 40, 70), (3, 70, 5)),
                                    ((5, 300), (300, 40)), ((2, 9, 70), (2, 70, 37)),
                                    ((1, 300), (300, 9)), ((37, 600), (600, 1))], ids=str)
def test_half_partials_block_by_block(monkeypatch, shapes):
    """Running sums computed block by block of the result (in cache: rows,
    or columns where the result is wider than tall) give the same values
    whatever the blocks (here of 16 or fewer, equal), and the model's."""
    from poptorchsim.machine import half_partials
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randn(s, generator=g).half() for s in shapes)
    whole = half_partials_mm(a, b)
    monkeypatch.setattr(half_partials, "_BLOCK", 1)
    assert torch.equal(half_partials_mm(a, b), whole)
    assert torch.equal(whole, _half_partials_by_the_book(a, b))


def test_half_partials_with_a_gpus_blocks_give_the_same_values(monkeypatch):
    """On a GPU the blocks and groups are larger (for memory, not cache):
    the values are the same."""
    from poptorchsim.machine import half_partials
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(2, 300, 2100, generator=g).half(), torch.randn(2100, 700, generator=g).half()
    on_cpu = half_partials_mm(a, b)
    monkeypatch.setattr(half_partials, "_limits",
                        lambda device: (half_partials._GPU_BLOCK, half_partials._GPU_SUMS_LIMIT))
    assert torch.equal(half_partials_mm(a, b), on_cpu)


@pytest.mark.parametrize("target", [torch.ops.aten.argmax.default, torch.ops.aten.argmin.default],
                         ids=str)
def test_index_of_an_fp16_value_computed_in_fp32_is_the_same(target):
    """argmax/argmin run on the widened values: the same index as fp16's
    kernel, ties (many in fp16) to the first, NaN as the extreme."""
    from poptorchsim.machine.precision import INDEX_OF_HALF, in_fp32
    assert target in INDEX_OF_HALF
    x = (torch.randn(6, 300) * 4).round().half()        # many ties
    x[5, 7] = float("nan")
    run = in_fp32(target, [torch.int64])
    for args in ((x,), (x, -1), (x, 0, True)):
        assert torch.equal(run(*args), target(*args))
