"""Overlapped host IO marks: PopTorch's ``set_overlap_for_input`` / ``_output``.

While a model is traced, ``mark(tensor, "input" | "output", mode)`` stores
the ``OverlapMode`` value on the fx node behind ``tensor`` (an input's
placeholder, or the op producing an output).  After tracing,
``overlapped_io(capture)`` reads the marks back as ``{input index: mode}``
and ``{output index: mode}`` and checks PopTorch's rules: an input is marked
before anything else uses it, only model inputs and returned tensors are
marked, and a marked output is returned once.
"""
import torch.utils._pytree as pytree
from torch.fx.experimental import proxy_tensor

from ..errors import Error
from .annotations import innermost

NOT_INPUT_ERR = ("poptorch.set_overlap_for_input applied on a node which is not a tensor "
                 "input to the model.")
NOT_OUTPUT_ERR = ("poptorch.set_overlap_for_output applied on a node which is not a "
                  "tensor output to the model.")
RETURNED_TWICE_ERR = (
    "poptorch.set_overlap_for_output cannot be used with a tensor that is returned "
    "twice. Please check all returned tensors including those nested in tuples/lists.")


def mark(tensor, kind, mode):
    """Records ``mode`` (a string) on the node behind ``tensor`` while tracing;
    does nothing outside tracing."""
    tracer = proxy_tensor.get_proxy_mode()
    if tracer is None:
        return
    proxy = proxy_tensor.get_proxy_slot(innermost(tensor), tracer.tracer, None,
                                        lambda slot: slot.proxy)
    if proxy is None:
        raise Error(NOT_INPUT_ERR if kind == "input" else NOT_OUTPUT_ERR)
    node = proxy.node
    # an input must be marked before any op reads it (PopTorch: the overlap
    # op is the input's only user)
    node.meta[f"overlap_{kind}"] = (mode, bool(node.users))


def overlapped_io(capture):
    """``({input index: mode}, {output index: mode})`` of a captured graph,
    modes as ``OverlapMode`` values; raises PopTorch's errors for misuse."""
    nodes = list(capture.graph.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    first_input = len(placeholders) - len(capture.example_inputs)
    inputs, outputs = {}, {}
    for i, node in enumerate(placeholders):
        if "overlap_input" not in node.meta:
            continue
        mode, used_before = node.meta["overlap_input"]
        if i < first_input:
            raise Error(NOT_INPUT_ERR)
        if used_before:
            raise Error("poptorch.set_overlap_for_input must be the only op applied to an "
                        f"input. This is not the case for input {i - first_input} to the "
                        "model.")
        inputs[i - first_input] = mode
    if any("overlap_input" in n.meta for n in nodes if n.op != "placeholder"):
        raise Error(NOT_INPUT_ERR)
    returned = _user_outputs(nodes[-1], capture.n_tensor_outputs)
    for node in nodes:
        if "overlap_output" not in node.meta:
            continue
        where = [k for k, out in enumerate(returned) if out is node]
        if not where:
            raise Error(NOT_OUTPUT_ERR)
        if len(where) > 1:
            raise Error(RETURNED_TWICE_ERR)
        outputs[where[0]] = node.meta["overlap_output"][0]
    return inputs, outputs


def _user_outputs(output_node, n):
    """The fx nodes of the model's ``n`` tensor outputs (the first ``n``
    leaves of the graph's output, before gradients and buffers)."""
    return pytree.tree_leaves(output_node.args[0])[:n]
