"""The operations an IPU graph may hold, each with its cost class.

The IR holds PyTorch's core ATen op set (``torch.Tag.core``) and the
composite operations named below; capture decomposes everything else that
PyTorch can decompose (``capture/decompositions.py``).  The machine turns a
cost class plus shapes into work per tile (``estimate/cost.py``):

=============== ============================================================
class           work on the tiles
=============== ============================================================
view            nothing: a new window on existing data
copy            data rearranged over the exchange
creation        tiles fill memory (constants, ranges)
random          the hardware PRNG, at half the vector rate
elementwise     one pass through the vector unit
transcendental  a quarter of the vector rate
reduction       a local pass, partials exchanged, a second pass
softmax/loss    three passes of a reduction
norm            four passes of a reduction
pool            a windowed reduction
gather          indexed reads or writes: indices and rows cross the exchange
sort            log2(n) compare-exchange rounds (sorting networks, scans)
matmul/conv     the AMP units (``estimate/cost._plan_matmul``)
custom          a user's custom op: the cycles and temporary memory its
                author declared (``ir.custom``, ``register_custom_op``)
loop            a loop: its body's cost times the count (``estimate/cost``)
cond            a conditional: the condition's trip to the control program,
                then the longer branch's cost
rnn             a fused recurrent layer (popnn's LSTM): the input projection
                as one matmul, then per time step a matmul and the gates'
                element-wise work (``estimate/cost._rnn_cost``)
host            the device stops while the host prints a tensor or runs a
                CPU op (``poptorchsim::ipu_print_tensor``, ``host_call``):
                bytes over PCIe each way plus the copies' latency
=============== ============================================================

An ATen operation not named here takes its class from its tags: pointwise
ops are element-wise, seeded ones random, reductions reductions, aliasing
ops views, and any other op that produces tensors is a copy (data moved,
touched once).  Nothing with tensor results is left without a cost.
"""
import functools
from typing import Any, Optional

import torch

from .custom import CUSTOM_NAMESPACE
from .kinds import CostClass

# cost class -> ATen operation names (OpOverloadPacket names, no overload)
_CLASSES = {
    "view": """view _unsafe_view reshape t transpose permute expand squeeze unsqueeze
        alias slice select detach unfold as_strided view_as_real view_as_complex
        split split_with_sizes unbind chunk narrow lift_fresh_copy unsafe_split
        unsafe_split_with_sizes unsafe_chunk movedim swapaxes swapdims expand_as
        view_as diagonal _reshape_alias unflatten flatten""",
    "copy": """clone copy _to_copy cat stack contiguous repeat flip roll
        constant_pad_nd pad reflection_pad1d reflection_pad2d reflection_pad3d
        replication_pad1d replication_pad2d replication_pad3d slice_scatter
        select_scatter diagonal_scatter as_strided_scatter slice_backward
        select_backward tril triu fill zero new_zeros new_ones new_empty new_full
        new_empty_strided reflection_pad1d_backward reflection_pad2d_backward
        reflection_pad3d_backward replication_pad1d_backward
        replication_pad2d_backward replication_pad3d_backward im2col col2im
        upsample_nearest1d upsample_nearest2d upsample_nearest3d
        upsample_nearest1d_backward upsample_nearest2d_backward
        upsample_nearest3d_backward _unsafe_index _unsafe_index_put""",
    "gather": """gather scatter scatter_add scatter_reduce index index_put
        index_select index_add index_copy index_fill index_reduce embedding
        embedding_dense_backward _embedding_bag _embedding_bag_backward
        _embedding_bag_dense_backward _embedding_bag_per_sample_weights_backward
        masked_fill masked_scatter take put _embedding_bag_forward_only segment_reduce
        _segment_reduce_backward histc histogram _histogramdd_from_bin_cts""",
    "creation": """zeros ones full empty zeros_like ones_like full_like empty_like
        scalar_tensor arange empty_strided linspace logspace eye""",
    "random": """bernoulli rand randn rand_like randn_like native_dropout
        native_dropout_backward uniform normal randint randperm rrelu_with_noise
        rrelu_with_noise_functional""",
    "matmul": """mm addmm bmm matmul baddbmm addmv mv dot linear _cdist_forward
        _cdist_backward addbmm addr vdot _trilinear _pdist_forward _pdist_backward
        linalg_solve_triangular triangular_solve cholesky_solve cholesky_inverse
        linalg_cholesky_ex linalg_lu_factor_ex linalg_lu_solve linalg_lu linalg_inv_ex
        _linalg_det _linalg_slogdet _linalg_solve_ex linalg_matrix_exp
        linalg_ldl_factor_ex linalg_ldl_solve""",
    "conv": """convolution convolution_backward""",
    "rnn": """mkldnn_rnn_layer mkldnn_rnn_layer_backward""",
    "elementwise": """add sub mul div neg abs relu threshold_backward clamp clamp_min
        clamp_max where eq ne lt le gt ge maximum minimum logical_not logical_and
        logical_or bitwise_not bitwise_and bitwise_or sign lerp addcmul addcdiv pow
        reciprocal hardtanh hardtanh_backward leaky_relu leaky_relu_backward rsub
        floor ceil round trunc remainder fmod square fill_ copy_
        _softmax_backward_data _log_softmax_backward_data elu elu_backward
        hardsigmoid hardswish hardsigmoid_backward hardswish_backward sigmoid_backward
        tanh_backward gelu_backward silu_backward isnan isinf sgn signbit nan_to_num
        logical_xor bitwise_xor atan2 hypot frac glu glu_backward softshrink_backward
        hardshrink_backward linalg_cross""",
    "transcendental": """exp log sqrt rsqrt tanh sigmoid erf gelu silu sin cos log1p
        expm1 exp2 log2 log10 softplus softplus_backward mish tan atan asin acos
        sinh cosh asinh acosh atanh erfinv erfc""",
    "reduction": """sum mean amax amin max min prod var var_mean std std_mean argmax
        argmin any all norm linalg_vector_norm logsumexp nansum trace count_nonzero
        renorm""",
    "sort": """sort topk kthvalue median nanmedian mode argsort msort cumsum cumprod
        cummax cummin logcumsumexp _cummax_helper _cummin_helper searchsorted
        bucketize""",
    "softmax": """_softmax _log_softmax""",
    "loss": """nll_loss_forward nll_loss_backward nll_loss2d_forward
        nll_loss2d_backward mse_loss mse_loss_backward l1_loss smooth_l1_loss
        smooth_l1_loss_backward binary_cross_entropy binary_cross_entropy_backward
        binary_cross_entropy_with_logits huber_loss huber_loss_backward
        multi_margin_loss multi_margin_loss_backward multilabel_margin_loss_forward
        multilabel_margin_loss_backward""",
    "pool": """max_pool2d_with_indices max_pool2d_with_indices_backward avg_pool2d
        avg_pool2d_backward _adaptive_avg_pool2d _adaptive_avg_pool2d_backward
        adaptive_max_pool2d adaptive_max_pool2d_backward max_pool1d avg_pool1d
        max_pool3d_with_indices max_pool3d_with_indices_backward avg_pool3d
        avg_pool3d_backward _adaptive_avg_pool3d _adaptive_avg_pool3d_backward
        adaptive_max_pool1d adaptive_max_pool3d adaptive_max_pool3d_backward
        upsample_bilinear2d upsample_bilinear2d_backward upsample_linear1d
        upsample_linear1d_backward upsample_trilinear3d upsample_trilinear3d_backward
        upsample_bicubic2d upsample_bicubic2d_backward _upsample_bilinear2d_aa
        grid_sampler_2d grid_sampler_2d_backward grid_sampler_3d grid_sampler_3d_backward
        fractional_max_pool2d fractional_max_pool3d _upsample_bilinear2d_aa_backward""",
    "norm": """native_layer_norm native_layer_norm_backward native_batch_norm_backward
        _native_batch_norm_legit_functional _native_batch_norm_legit_no_training
        _native_batch_norm_legit native_batch_norm native_group_norm
        native_group_norm_backward""",
}

class ControlFlow:
    """The target of a loop or conditional op (its numerics are its
    sub-graphs, run by the engine)."""

    def __init__(self, name):
        self.__name__ = name

    @property
    def overloadpacket(self):
        return self

    def __repr__(self):
        return f"poptorchsim.{self.__name__}"


LOOP = ControlFlow("for_loop")
COND = ControlFlow("cond")

COST_CLASS: dict[str, str] = {}
for _cls, _names in _CLASSES.items():
    for _op in _names.split():
        COST_CLASS.setdefault(_op, _cls)
# poptorchsim's own ops whose kernels run on the host (capture/host_ops.py)
HOST_OP_NAMES = ("ipu_print_tensor", "host_call")
COST_CLASS.update(dict.fromkeys(HOST_OP_NAMES, "host"))


def _name(target: Any) -> str:
    packet = getattr(target, "overloadpacket", None)
    return str(getattr(packet, "__name__", None) or getattr(target, "__name__", target))


# torch.Tag.inplace came with torch 2.12; before it the schema says the same: the
# first argument written to, the name ending in "_", but for these overloads,
# which the tag leaves out (checked against the tag on torch 2.14)
_INPLACE_TAG = getattr(torch.Tag, "inplace", None)
_UNTAGGED_INPLACE = frozenset({"add_.t", "mul_.t", "copy_.Tensor", "copy_.int", "copy_.float",
                               "index_put_.hacked_twin", "_index_put_impl_.hacked_twin",
                               "shallow_copy_data_.default"})


def _inplace_by_schema(target):
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    first, name = schema.arguments[0], _name(target)
    return (first.alias_info is not None and first.alias_info.is_write and not first.kwarg_only
            and name.endswith("_") and not name.startswith("_no_grad_")
            and f"{name}.{target._overloadname}" not in _UNTAGGED_INPLACE)


def is_inplace(target: Any) -> bool:
    """An ATen operation that writes into its first argument (``add_``,
    ``squeeze_``): capture leaves these only where a decomposition made them
    on tensors of its own, and the engine runs them in place."""
    tags = getattr(target, "tags", ())
    if torch.Tag.inplace_view in tags:
        return True
    if _INPLACE_TAG is not None:
        return _INPLACE_TAG in tags
    return _inplace_by_schema(target)


def is_native(target: Any) -> bool:
    """Lowered as it is (never decomposed): core ATen or named above."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return torch.Tag.core in target.tags or _name(target) in COST_CLASS


def _returns_alias(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write
                                      for r in schema.returns)


# poptorchsim's own library ops that reach the IR (``capture.custom_ops``):
# ``nop`` is a copy the compiler keeps.  Users' custom ops are class
# ``custom``, costed as their authors declare (``ir.custom``).
_OWN_OPS = {"nop": "copy",
            # automatic loss scaling (passes/loss_scaling.py)
            "gradient_histogram": "reduction", "loss_scale_update": "elementwise"}


# Iterative factorizations: LAPACK loops until convergence; neither Poplar's
# libraries nor PopTorch have them on the IPU.
_NO_IPU_KERNEL = """_linalg_svd linalg_svd svd linalg_eig _linalg_eig linalg_eigh _linalg_eigh
    linalg_eigvals linalg_eigvalsh linalg_qr geqrf linalg_lstsq linalg_householder_product
    ormqr""".split()


def unsupported_reason(target: Any) -> Optional[str]:
    """Why ``target`` cannot be lowered, or None when it can."""
    name = _name(target)
    if name in _NO_IPU_KERNEL:
        return "an iterative matrix factorization with no IPU implementation"
    if cost_class(target) is not None:
        return None
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return "not an ATen operation"
    return "its output shape depends on tensor values"


@functools.lru_cache(maxsize=None)
def cost_class(target: Any) -> Optional[CostClass]:
    """The cost class of an ATen overload, or None when it cannot be lowered
    (not an ATen operation, or one PyTorch gives a dynamic output shape)."""
    name = _cost_class_name(target)
    return CostClass(name) if name is not None else None


def _cost_class_name(target: Any) -> Optional[str]:
    name = _name(target)
    namespace = getattr(target, "namespace", None)
    if namespace == CUSTOM_NAMESPACE:
        return "custom"
    if namespace == "poptorchsim" and name in _OWN_OPS:
        return _OWN_OPS[name]
    if name in COST_CLASS:
        return COST_CLASS[name]
    if name.endswith("_") and name[:-1] in COST_CLASS:       # in-place variant
        return "view" if torch.Tag.inplace_view in target.tags else COST_CLASS[name[:-1]]
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    tags = target.tags
    if torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags:
        return None
    if torch.Tag.inplace_view in tags or _returns_alias(target):
        return "view"
    if torch.Tag.pointwise in tags:
        return "elementwise"
    if torch.Tag.nondeterministic_seeded in tags:
        return "random"
    if torch.Tag.reduction in tags:
        return "reduction"
    return "copy"
