"""What each operator of the ``torch.ops.poptorch`` library does: the
Python API call it stands for (PopTorch's ``python/*.py`` call these
operators; here they call the API).  ``op_library.py`` registers them.

Arguments arrive as the operator's schema has them
(``poptorch/source/dispatch_tracer/RegisterAtenOverloads.cpp``): enums as
ints or strings, booleans as ints, a custom op's attributes as a string.
"""
import json
import logging

import torch

from .. import annotations, enums, ops
from ..capture import blocks as _blocks
from ..capture import scopes as _scopes
from ..capture.annotations import annotate_producer
from ..errors import Error, UnsupportedOperationError, createPoptorchError
from . import ctc, graph_ops, overlap


# -- blocks ----------------------------------------------------------------------------
def begin_ipu_block(stage_id, phase_id, ipu_id):
    """Ops traced from now on run in stage ``stage_id`` on IPU ``ipu_id``:
    ``poptorch.Block.start(user_id=str(stage_id), ipu_id=ipu_id)``, the block
    PopTorch's strategies begin for a stage.  The stage is the block's id,
    so the execution strategy places it as it places a ``BeginBlock`` with
    that id (by default on the stage of its IPU); ``phase_id`` is PopTorch's
    phase, which poptorchsim takes from the strategy's ``Phase``s."""
    annotations.Block.start(str(stage_id), ipu_id)
    if (stage_id != ipu_id or phase_id != 0) and (stage_id, phase_id, ipu_id) not in _NOTED \
            and _blocks.is_recording():
        _NOTED.add((stage_id, phase_id, ipu_id))
        logging.getLogger("poptorchsim").warning(
            "torch.ops.poptorch.begin_ipu_block(%d, %d, %d): poptorchsim enters block %r "
            "on IPU %d and lets the execution strategy place it, as a BeginBlock with that "
            "id; it does not take stage and phase ids from the call (by default a block's "
            "stage is its IPU's). Name the stages with the strategy instead, for example "
            "PipelinedExecution(Stage(\"0\"), Stage(\"1\"), ...).",
            stage_id, phase_id, ipu_id, str(stage_id), ipu_id)


_NOTED = set()        # begin_ipu_block calls whose stage or phase was noted as not taken


def end_ipu_block():
    """Leaves the block: ops traced next belong to no block until another
    begins (PopTorch refuses them), as after ``with poptorch.Block(...)``."""
    _blocks.leave_block(None)


# -- scopes ----------------------------------------------------------------------------
def push_name_scope(name):
    _scopes.push_name_scope(name)


def pop_name_scope():
    _scopes.pop_name_scope()


def set_attribute(attribute, key, value):
    _scopes.set_attribute(attribute, key, value)


def clear_attribute(attribute, key):
    _scopes.clear_attribute(attribute, key)


def begin_multi_conv():
    """``poptorch.MultiConv().__enter__()``; ``end_multi_conv`` closes it."""
    state = _blocks.trace_state()
    if state is None:
        return
    multiconv = graph_ops.MultiConv()
    multiconv.__enter__()
    state.setdefault("multiconvs", []).append(multiconv)


_PARTIALS = {0: torch.float32, 1: torch.float16}


def end_multi_conv(available_memory_proportions, partials_types, plan_type,
                   per_conv_reserved_tiles, cycle_back_off, enableConvDithering):
    """Closes the ``MultiConv`` of ``begin_multi_conv`` with these options
    (PopTorch's encodings: partials 0 float / 1 half, plan 0 Parallel /
    1 Serial, dithering as ints)."""
    state = _blocks.trace_state()
    if state is None:
        return
    opened = state.get("multiconvs")
    if not opened:
        raise Error("Unexpected end_multi_conv, is the IR malformed? "
                    "(torch.ops.poptorch.end_multi_conv was called with no "
                    "begin_multi_conv() open; use `with poptorch.MultiConv():`)")
    multiconv = opened.pop()
    if available_memory_proportions is not None:
        multiconv.availableMemoryProportions([float(v) for v in available_memory_proportions])
    if partials_types is not None:
        if any(p not in _PARTIALS for p in partials_types):
            raise ValueError("Invalid partials types. Expecting 0 (torch.float) or "
                             f"1 (torch.half), got {list(partials_types)}")
        multiconv.partialsTypes([_PARTIALS[p] for p in partials_types])
    if plan_type is not None:
        multiconv.planType(enums.MultiConvPlanType(plan_type))
    if per_conv_reserved_tiles is not None:
        multiconv.perConvReservedTiles(per_conv_reserved_tiles)
    if cycle_back_off is not None:
        multiconv.cycleBackOff(float(cycle_back_off))
    if enableConvDithering is not None:
        multiconv.enableConvDithering([bool(v) for v in enableConvDithering])
    multiconv.__exit__(None, None, None)


# -- identity-like annotations ----------------------------------------------------------
_FLOAT_FORMATS = ("auto", "fixed", "scientific", "none")      # PopTorch's codes 0..3


def ipu_print_tensor(self, title, print_gradient, summarize_threshold, edge_items,
                     max_line_width, digits, float_format, separator, open_bracket,
                     close_bracket):
    if not 0 <= float_format < len(_FLOAT_FORMATS):
        raise Error(f"ipu_print_tensor: float_format {float_format} is not one of 0 (auto), "
                    "1 (fixed), 2 (scientific), 3 (none).")
    return ops.ipu_print_tensor(self, title, bool(print_gradient), summarize_threshold,
                                edge_items, max_line_width, digits,
                                _FLOAT_FORMATS[float_format], separator, open_bracket,
                                close_bracket)


def nop(self):
    return graph_ops.nop(self)


def recomputation_checkpoint(self):
    return annotations.recomputationCheckpoint(self)


def set_available_memory(t, mem):
    return ops.set_available_memory(t, mem)


def set_matmul_serialization(matmul, mode, factor, keep_precision):
    """Marks the matmul that produced ``matmul`` as ``serializedMatMul``
    does (``mode``: a ``MatMulSerializationMode`` value string)."""
    modes = {m.value: m for m in enums.MatMulSerializationMode}
    if mode not in modes:
        raise Error(f"set_matmul_serialization: mode {mode!r} is not one of "
                    f"{', '.join(map(repr, modes))}.")
    if modes[mode] is enums.MatMulSerializationMode.Disabled:
        return matmul
    if factor < 1:
        raise createPoptorchError(f"serializedMatMul: the factor must be at least 1 to "
                                  f"serialize on {mode}, got {factor}.")
    # the result shows the rows (input channels) and columns (output channels);
    # the reducing dimension is the operands' and is not checked here
    length = {"input_channels": matmul.shape[-2] if matmul.dim() > 1 else 1,
              "output_channels": matmul.shape[-1] if matmul.dim() else 1}.get(mode)
    if length is not None and length % factor != 0:
        raise createPoptorchError(
            f"serializedMatMul: the factor ({factor}) must divide the {mode} "
            f"dimension ({length}); pick a factor of {length}.")
    annotate_producer(matmul, "serialization", (mode, factor, keep_precision))
    return matmul


def _overlap_mode(mode, kind):
    modes = {m.value: m for m in enums.OverlapMode}
    if mode not in modes:
        raise Error(f"set_overlap_for_{kind}: mode {mode!r} is not one of "
                    f"{', '.join(map(repr, modes))}.")
    return modes[mode]


def set_overlap_for_input(t, mode):
    return overlap.set_overlap_for_input(t, _overlap_mode(mode, "input"))


def set_overlap_for_output(t, mode):
    return overlap.set_overlap_for_output(t, _overlap_mode(mode, "output"))


# -- ops with results -------------------------------------------------------------------
_REDUCTIONS = {0: "sum", 1: "mean", 2: "none"}


def identity_loss(x, reduction):
    if reduction not in _REDUCTIONS:
        raise Error(f"reduction must be sum (0), mean (1) or none (2), got {reduction}")
    return ops.identity_loss(x, _REDUCTIONS[reduction])


# ONNX type names (PopART's cast) -> torch dtypes; the IPU holds no 64-bit types
CAST_TYPES = {"FLOAT": torch.float32, "FLOAT32": torch.float32, "FLOAT16": torch.float16,
              "INT32": torch.int32, "INT16": torch.int16, "INT8": torch.int8,
              "UINT8": torch.uint8, "BOOL": torch.bool}


def internal_cast(self, dtype):
    """``self`` cast to the ONNX type ``dtype`` ("FLOAT", "FLOAT16", ...)."""
    if dtype not in CAST_TYPES:
        raise Error(f"internal_cast: unknown type {dtype!r}; the IPU casts to one of "
                    f"{', '.join(CAST_TYPES)}.")
    return self.to(CAST_TYPES[dtype])


def ctc_beam_search_decoder(probs, lengths, blank, beam_width, top_paths):
    return ctc.ctc_beam_search_decoder(probs, lengths, blank, beam_width, top_paths)


def dynamic_slice(self, dim, start, size, step):
    return graph_ops.dynamic_slice(self, dim, start, size, step)


def dynamic_update(self, src, dim, start, size):
    return graph_ops.dynamic_update(self, src, dim, start, size)


def custom_operation(inputs, name, domain, domain_version, num_outputs, outputs,
                     attributes):
    """``poptorch.custom_op(inputs, name, domain, domain_version, outputs,
    attributes)``; ``attributes`` is a JSON object ("" or "{}" for none)."""
    if num_outputs != len(outputs):
        raise Error(f"custom_operation {name!r}: num_outputs is {num_outputs} but "
                    f"{len(outputs)} example outputs were given.")
    try:
        parsed = json.loads(attributes) if attributes.strip() else None
    except ValueError:
        parsed = False
    if parsed is not None and not isinstance(parsed, dict):
        raise Error(f"custom_operation {name!r}: attributes must be a JSON object of the "
                    f"op's attributes (or \"\"), got {attributes!r}. PopTorch passes an id "
                    "of its own here: call poptorch.custom_op(..., attributes={...}) "
                    "instead.")
    return graph_ops.custom_op(list(inputs), name, domain, domain_version, list(outputs),
                               parsed)


# -- operators that are PopTorch's own plumbing -----------------------------------------
_PLUMBING = {
    "start_for_loop": "poptorch.for_loop(count, body, inputs)",
    "end_for_loop": "poptorch.for_loop(count, body, inputs)",
    "start_if_block": "poptorch.cond(condition, then_body, then_inputs, else_body, "
                      "else_inputs)",
    "start_else_block": "poptorch.cond(...)",
    "end_if_block": "poptorch.cond(...)",
    "call_cpu_op": "poptorch.CPU(layer_to_call, ID)",
    "end_cpu_op": "poptorch.CPU(layer_to_call, ID)",
    "optimizer_group": "poptorch.trainingModel(model, options, optimizer) (the optimizer's "
                       "param_groups are the groups)",
}


def plumbing(name):
    """A handler for half of one of PopTorch's Python constructs."""
    def refuse(*args, **kwargs):
        raise UnsupportedOperationError(
            f"torch.ops.poptorch.{name} is one half of a construct PopTorch's Python API "
            f"builds, meaningless alone; poptorchsim does not simulate it called "
            f"directly. Use {_PLUMBING[name]}.")
    return refuse


_NOT_SIMULATED = {
    "fps": "torch_cluster's farthest point sampling",
    "nearest": "torch_cluster's nearest",
    "nearest_batch_list": "torch_cluster's nearest",
}


def not_simulated(name):
    def refuse(*args, **kwargs):
        raise UnsupportedOperationError(
            f"torch.ops.poptorch.{name} ({_NOT_SIMULATED[name]}) is not simulated by "
            "poptorchsim: the simulated IPU has no cost model or kernel for it. Compute it "
            "on the host, outside the model (for example on the model's outputs).")
    return refuse


HANDLERS = {
    "begin_ipu_block": begin_ipu_block, "end_ipu_block": end_ipu_block,
    "push_name_scope": push_name_scope, "pop_name_scope": pop_name_scope,
    "set_attribute": set_attribute, "clear_attribute": clear_attribute,
    "begin_multi_conv": begin_multi_conv, "end_multi_conv": end_multi_conv,
    "ipu_print_tensor": ipu_print_tensor, "nop": nop,
    "recomputation_checkpoint": recomputation_checkpoint,
    "set_available_memory": set_available_memory,
    "set_matmul_serialization": set_matmul_serialization,
    "set_overlap_for_input": set_overlap_for_input,
    "set_overlap_for_output": set_overlap_for_output,
    "identity_loss": identity_loss, "internal_cast": internal_cast,
    "dynamic_slice": dynamic_slice, "dynamic_update": dynamic_update,
    "custom_operation": custom_operation, "ctc_beam_search_decoder": ctc_beam_search_decoder,
    **{name: plumbing(name) for name in _PLUMBING},
    **{name: not_simulated(name) for name in _NOT_SIMULATED},
}
