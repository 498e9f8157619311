"""The operations an IPU graph may hold, each with its cost class.

The machine turns a cost class plus shapes into work per tile.  An ATen
operation missing from this table is unsupported: lowering lists every such
operation of a model in one error.
"""

# cost class -> ATen operation names (OpOverloadPacket names, no overload)
_CLASSES = {
    "view": """view _unsafe_view reshape t transpose permute expand squeeze unsqueeze
        alias slice select detach unfold as_strided view_as_real view_as_complex
        split split_with_sizes unbind chunk narrow lift_fresh_copy""",
    "copy": """clone copy _to_copy cat stack contiguous index_select repeat flip roll
        constant_pad_nd pad reflection_pad2d replication_pad2d gather scatter
        scatter_add index index_put slice_scatter select_scatter slice_backward
        select_backward embedding embedding_dense_backward masked_fill tril triu
        diagonal fill zero new_zeros new_ones new_empty new_full""",
    "creation": """zeros ones full empty zeros_like ones_like full_like empty_like
        scalar_tensor arange empty_strided""",
    "random": """bernoulli rand randn rand_like randn_like native_dropout
        native_dropout_backward uniform normal randint randperm""",
    "matmul": """mm addmm bmm matmul baddbmm addmv mv dot linear""",
    "conv": """convolution convolution_backward""",
    "elementwise": """add sub mul div neg abs relu threshold_backward clamp clamp_min
        clamp_max where eq ne lt le gt ge maximum minimum logical_not logical_and
        logical_or bitwise_not bitwise_and bitwise_or sign lerp addcmul addcdiv pow
        reciprocal hardtanh hardtanh_backward leaky_relu leaky_relu_backward rsub
        floor ceil round trunc remainder fmod square masked_scatter fill_ copy_
        _softmax_backward_data _log_softmax_backward_data elu elu_backward
        hardsigmoid hardswish hardsigmoid_backward hardswish_backward sigmoid_backward
        tanh_backward gelu_backward silu_backward isnan isinf sgn signbit nan_to_num
        logical_xor bitwise_xor atan2 hypot frac""",
    "transcendental": """exp log sqrt rsqrt tanh sigmoid erf gelu silu sin cos log1p
        expm1 exp2 log2 log10 softplus softplus_backward mish tan atan asin acos
        sinh cosh asinh acosh atanh erfinv erfc""",
    "reduction": """sum mean amax amin max min prod var var_mean std std_mean argmax
        argmin any all norm linalg_vector_norm cumsum logsumexp""",
    "softmax": """_softmax _log_softmax""",
    "loss": """nll_loss_forward nll_loss_backward nll_loss2d_forward
        nll_loss2d_backward mse_loss mse_loss_backward l1_loss smooth_l1_loss
        smooth_l1_loss_backward binary_cross_entropy binary_cross_entropy_backward
        binary_cross_entropy_with_logits huber_loss huber_loss_backward""",
    "pool": """max_pool2d_with_indices max_pool2d_with_indices_backward avg_pool2d
        avg_pool2d_backward _adaptive_avg_pool2d _adaptive_avg_pool2d_backward
        adaptive_max_pool2d adaptive_max_pool2d_backward max_pool1d avg_pool1d
        max_pool3d_with_indices avg_pool3d upsample_nearest2d
        upsample_nearest2d_backward upsample_bilinear2d""",
    "norm": """native_layer_norm native_layer_norm_backward native_batch_norm_backward
        _native_batch_norm_legit_functional native_group_norm
        native_group_norm_backward""",
}

COST_CLASS = {name: cls for cls, names in _CLASSES.items() for name in names.split()}


def cost_class(target):
    """The cost class of an ATen overload, or None when unsupported."""
    packet = getattr(target, "overloadpacket", None)
    name = getattr(packet, "__name__", None) or getattr(target, "__name__", str(target))
    return COST_CLASS.get(name)
