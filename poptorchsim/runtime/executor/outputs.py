"""A call's outputs as PopTorch returns them: the rows the engine collected
assembled into the model's output structure (host tensors, int64 as int32,
float64 as float32, no autograd), constants once; and the output mode's
checks before compiling."""
import torch
import torch.utils._pytree as pytree

from ... import enums
from ...errors import Error

BACKWARD_ERR = (
    "backward() cannot be called explicitly on outputs of a PopTorch model. If "
    "you're using a trainingModel, the backwards pass is performed automatically "
    "when invoking the model. If you're using an inferenceModel, you should use a "
    "trainingModel instead.")


def _raise_backward(*_args, **_kwargs):
    raise Error(BACKWARD_ERR)


def input_independent_outputs(compiled):
    """Indices of user outputs that do not depend on any input (constants)."""
    graph = next(iter(compiled.program.graphs.values()))
    dependent = {t.id for t in graph.inputs if t.role == "input"}
    for op in graph.ops:
        if any(t.id in dependent for t in op.input_tensors()):
            dependent.update(t.id for t in op.outputs if t is not None)
    n = compiled.capture.n_tensor_outputs
    return {k for k, t in enumerate(graph.outputs[:n]) if t.id not in dependent}


def check_output_period(options, mode):
    """PopTorch's checks of ``OutputMode.EveryN``'s period, before compiling."""
    di = options.device_iterations
    period = options.output_return_period
    if mode != enums.OutputMode.EveryN:
        return
    if period > di:
        raise Error(f"Return period must be <= to the number of batches per step: "
                    f"OutputMode.EveryN period {period} > deviceIterations {di}. "
                    "Lower the period or raise deviceIterations.")
    if di % period:
        raise Error(f"Return period must be a factor of the number of batches per "
                    f"step: deviceIterations {di} is not a multiple of the "
                    f"OutputMode.EveryN period {period}.")


def assemble(compiled, rows, constant_outputs):
    """The model's outputs from the engine's ``rows`` (one per returned
    micro-batch), as PopTorch returns them."""
    cap = compiled.capture
    outs = []
    for k in range(cap.n_tensor_outputs):
        parts = [row[k] for row in rows]
        if k in constant_outputs:     # host-side constant: b_dim is 1
            parts = parts[:1]
        if len(parts) == 1:
            t = parts[0]
        elif parts[0].dim() == 0:
            t = torch.stack(parts)
        else:
            t = torch.cat(parts)
        if t.dtype == torch.int64:
            t = t.int()
        elif t.dtype == torch.float64:
            t = t.float()
        t = t.detach().cpu()                # outputs come back to the host
        t.backward = _raise_backward
        outs.append(t)
    leaves = [outs[d[1]] if d[0] == "tensor" else d[1] for d in cap.output_leaves]
    return pytree.tree_unflatten(leaves, cap.output_spec)
