"""A model compiled without weights (its parameters or buffers on PyTorch's
``meta`` device): what it may do and the error for what it may not.

Such a model compiles to the same program, memory report and cycle
estimate as the same model with weights (``capture/weightless.py`` traces
it), so a large model can be sized without holding its weights on the
host.  It has no values to run on, so the executor uploads nothing (no
device copy of the weights, buffers or optimizer state is made) and every
call that needs values raises ``NoWeightsError``, the executor unchanged.
"""
from ...capture.weightless import has_meta_state, meta_tensors
from ...errors import NoWeightsError


def no_weights_error(model, what):
    """The ``NoWeightsError`` for ``what`` (``"run the model"``) on ``model``."""
    names = meta_tensors(model)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    where = (f"{len(names)} of its parameters and buffers are on the meta device: {shown}"
             if names else "it was compiled while its parameters were on the meta device")
    return NoWeightsError(
        f"Cannot {what}: the model was built without weights ({where}). A model without "
        "weights can be compiled for estimates - model.compile(*inputs), then "
        "memoryReport(), cycleEstimate(), simulationReport(), getIR() - but not run. "
        "To run it, give it weights before wrapping it: build it on the CPU, or "
        "materialise it with model.to_empty(device='cpu') and then initialise its "
        "parameters (reset_parameters()) or load them (model.load_state_dict(state)); "
        "then wrap it again with poptorch.trainingModel (with an optimizer over its "
        "new parameters) or poptorch.inferenceModel.")


def require_weights(model, what, compiled_without=False, not_compiled=True):
    """Raises ``NoWeightsError`` for ``what`` if ``model`` was compiled
    without weights (``compiled_without``) or, not compiled yet, has a
    parameter or buffer on meta."""
    if compiled_without or (not_compiled and has_meta_state(model)):
        raise no_weights_error(model, what)
