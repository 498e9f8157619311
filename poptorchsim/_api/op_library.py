"""The ``torch.ops.poptorch`` operator library, with PopTorch's schemas.

PopTorch registers its ``poptorch`` library in C++
(``poptorch/source/dispatch_tracer/RegisterAtenOverloads.cpp``,
``TORCH_LIBRARY(poptorch, m)``); its Python API and some programs call
those operators.  poptorchsim defines the same operators, when it is
imported, with one kernel each: a ``CompositeImplicitAutograd`` kernel that
calls the operator's handler (``op_handlers.py``: the Python API call it
stands for).  One kernel serves every backend and mode: eager CPU tensors
(autograd flows through the ops the handler runs), meta and fake tensors,
``make_fx`` and ``torch.func`` transforms, since PyTorch decomposes such a
kernel wherever the operator is called.  While poptorchsim traces a model
the call does not even reach the dispatcher: ``capture.op_calls`` sends it
to the same handler first, so it traces as the Python API does.

Where another library (PopTorch itself) already owns the ``poptorch``
namespace, nothing is defined and a note is logged; calls made while
poptorchsim traces a model still go to poptorchsim's handlers.
"""
import logging

import torch

from ..capture import op_calls
from .op_handlers import HANDLERS

# PopTorch's schemas, as its TORCH_LIBRARY block defines them
SCHEMAS = {
    "begin_ipu_block": "(int stage_id, int phase_id, int ipu_id) -> ()",
    "end_ipu_block": "() -> ()",
    "start_for_loop": "(Tensor[] inputs) -> ()",
    "start_if_block": "(Tensor condition) -> ()",
    "start_else_block": "(Tensor[] outputs_true) -> ()",
    "optimizer_group": "(int group, Tensor[] inputs) -> ()",
    "begin_multi_conv": "() -> ()",
    "end_multi_conv": "(float[]? available_memory_proportions, int[]? partials_types, "
                      "int? plan_type, int? per_conv_reserved_tiles, float? cycle_back_off, "
                      "int[]? enableConvDithering) -> ()",
    "push_name_scope": "(str name) -> ()",
    "pop_name_scope": "() -> ()",
    "set_attribute": "(str attribute, str key, str value) -> ()",
    "clear_attribute": "(str attribute, str key) -> ()",
    "ipu_print_tensor": "(Tensor self, str title, int print_gradient, int "
                        "summarize_threshold, int edge_items, int max_line_width, "
                        "int digits, int float_format, str separator, str open_bracket, "
                        "str close_bracket) -> Tensor",
    "nop": "(Tensor self) -> Tensor",
    "end_for_loop": "(Tensor[] outputs, Tensor[] inputs, int trip_count) -> Tensor[]",
    "end_if_block": "(Tensor[] outputs, Tensor condition) -> Tensor[]",
    "set_matmul_serialization": "(Tensor matmul, str mode, int factor, "
                                "bool keep_precision) -> Tensor",
    "set_overlap_for_input": "(Tensor t, str mode) -> Tensor",
    "set_overlap_for_output": "(Tensor t, str mode) -> Tensor",
    "recomputation_checkpoint": "(Tensor self) -> Tensor",
    "set_available_memory": "(Tensor t, float mem) -> Tensor",
    "custom_operation": "(Tensor[] inputs, str name, str domain, int domain_version, "
                        "int num_outputs, Tensor[] outputs, str attributes) -> Tensor[]",
    "ctc_beam_search_decoder": "(Tensor probs, Tensor lengths, int blank, int beam_width, "
                               "int top_paths) -> (Tensor, Tensor, Tensor)",
    "dynamic_slice": "(Tensor self, int dim, Tensor start, int size, int step) -> Tensor",
    "dynamic_update": "(Tensor self, Tensor src, int dim, Tensor start, int size) -> Tensor",
    "identity_loss": "(Tensor x, int reduction) -> Tensor",
    "internal_cast": "(Tensor self, str dtype) -> Tensor",
    "end_cpu_op": "(Tensor[] output) -> Tensor[]",
    "call_cpu_op": "(Tensor[] inputs, str name) -> ()",
    "fps": "(Tensor src, int[] ptr, float ratio, bool random_start) -> Tensor",
    "nearest": "(Tensor x, Tensor y, Tensor batch_x, Tensor batch_y) -> Tensor",
    "nearest_batch_list": "(Tensor x, Tensor y, int[] batch_x, int[] batch_y) -> Tensor",
}

_logger = logging.getLogger("poptorchsim")
_LIBRARIES = {}            # namespace -> the torch.library.Library poptorchsim defined


def _kernel(name):
    handler = HANDLERS[name]

    def kernel(*args, **kwargs):
        return handler(*args, **kwargs)
    kernel.__name__ = f"poptorch_{name}"
    return kernel


def register(namespace=op_calls.NAMESPACE):
    """Defines the operators in ``namespace`` (PopTorch's, by default);
    returns the ``torch.library.Library``, or None where the namespace is
    already another library's (a note is logged)."""
    if namespace in _LIBRARIES:
        return _LIBRARIES[namespace]
    try:
        library = torch.library.Library(namespace, "DEF")
    except RuntimeError as exc:
        if "Only a single TORCH_LIBRARY" not in str(exc):
            raise
        _logger.warning(
            "torch.ops.%s is already defined by another library (PopTorch itself?): "
            "poptorchsim does not define its operators there. While poptorchsim traces a "
            "model, torch.ops.%s calls still do what poptorchsim's API does.",
            namespace, namespace)
        return None
    for name, schema in SCHEMAS.items():
        library.define(name + schema)
        library.impl(name, _kernel(name), "CompositeImplicitAutograd")
    _LIBRARIES[namespace] = library
    return library


for _name in SCHEMAS:
    op_calls.register_handler(_name, HANDLERS[_name])
register()
