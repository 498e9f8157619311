"""PopTorch's graph-level helper ops that are part of the face."""
import torch

from .capture import losses as _losses


def identity_loss(x, reduction):
    """Marks ``x`` as the final loss; backpropagation starts here.

    ``reduction`` is ``"sum"``, ``"mean"`` or ``"none"``, as in PopTorch.
    """
    assert reduction in ("sum", "mean", "none"), "Unsupported reduction type!"
    if reduction == "sum":
        out = torch.sum(x)
    elif reduction == "mean":
        out = torch.mean(x)
    else:
        out = x.clone()
    _losses.record_identity_loss(out)
    return out


def set_available_memory(tensor, available_memory_proportion):
    """Identity that sets the available-memory proportion (default 0.6) of the
    matmul or convolution producing ``tensor``: the share of each tile's memory
    its planner may use for temporary operand buffers.  Lower values use less
    memory and more cycles."""
    proportion = float(available_memory_proportion)
    if not 0.0 < proportion <= 1.0:
        raise ValueError(f"available_memory_proportion must be in (0, 1], got {proportion}")
    from .capture.annotations import annotate
    annotate(tensor, "available_memory", proportion)
    return tensor


def isRunningOnIpu():
    """True only while poptorchsim traces a model for compilation."""
    from .capture import trace
    return trace.is_tracing()


def ipuHardwareIsAvailable(num_ipus=1):
    """Is there IPU hardware with ``num_ipus`` IPUs?  No, by default: the
    IPUs are simulated.  With ``POPTORCHSIM_IPU_HARDWARE`` set (or
    ``python -m poptorchsim.run --ipu-hardware on``) the simulated system
    reports its IPUs as hardware, so that programs which run only where
    this is True run unchanged; their models then follow PopTorch's rules
    for hardware (``docs/porting.md``)."""
    from .estimate.targets import hardware_ipus
    ipus = hardware_ipus()
    return ipus is not None and num_ipus <= ipus


def ipuHardwareVersion():
    """The version of the simulated IPU (2 for Mk2, 21 for Bow, 1 for Mk1).

    PopTorch returns the version of the IPU hardware in the system and
    raises AssertionError "No IPU hardware available on this system" where
    there is none.  poptorchsim has no hardware (``ipuHardwareIsAvailable()``
    is False) but always has its simulated target, so programs that pick a
    version for ``useOfflineIpuTarget(poptorch.ipuHardwareVersion())`` work:
    it is the target that ``Options()`` compiles for by default
    (POPTORCHSIM_IPU_MODEL_VERSION, else Mk2).  The 4-tile test IPU is a
    small Mk2."""
    from .estimate.targets import default_target
    return _IPU_VERSIONS[default_target(None).name]


_IPU_VERSIONS = {"Mk1": 1, "Mk2": 2, "Bow": 21, "IPU-Test": 2}     # Target.name -> version


def ipu_print_tensor(tensor, title="", print_gradient=True, summarise_threshold=1000,
                     edge_items=3, max_line_width=80, digits=4, float_format="auto",
                     separator=", ", open_bracket="(", close_bracket=")"):
    """Identity op that prints ``tensor`` every time the graph runs (each
    micro-batch) and, in training when ``print_gradient``, its gradient in
    the backward pass (titled ``"<title>_gradient"``).  Printed to stderr,
    laid out as Poplar's ``PrintTensor`` (``capture/tensor_text.py``); each
    print costs a device-to-host copy in the cycle estimate.  Use the
    returned tensor in place of ``tensor``, as in PopTorch."""
    from .capture.host_ops import traced_print
    from .capture.tensor_text import check_format_arguments
    from .errors import Error
    if not isinstance(tensor, torch.Tensor):
        raise Error("ipu print tensor must take a torch.tensor argument. "
                    f"{type(tensor)} is not supported.")
    check_format_arguments(summarise_threshold, edge_items, max_line_width, digits,
                           float_format, separator, open_bracket, close_bracket)
    fmt = (summarise_threshold, edge_items, max_line_width, digits, float_format,
           separator, open_bracket, close_bracket)
    return traced_print(tensor, str(title), bool(print_gradient), fmt)


class CPU:
    """PopTorch's ``poptorch.CPU(layer_to_call, ID)``: calling it inside an
    inference model's ``forward`` runs ``layer_to_call`` on the host in the
    middle of the graph, with the real values: the device sends the inputs
    to the host, waits, and receives the outputs (that round trip is in the
    cycle estimate).  Outside a model (plain PyTorch) it just calls the
    function.  Training models cannot hold CPU ops, as in PopTorch."""

    def __init__(self, layer_to_call, ID):
        from .capture.host_ops import HostCallable
        if isinstance(layer_to_call, torch.nn.Module):
            layer_to_call.requires_grad_(False)
        self._layer_to_call = layer_to_call
        self._ID = ID
        self._host = HostCallable(layer_to_call, str(ID))
        # PopTorch's record of the last call: shapes, then persistent buffers
        self.in_shapes = None
        self.out_shapes = None
        self.inputs = None
        self.outputs = None

    def __call__(self, *inputs):
        from .capture import trace
        from .errors import Error
        if not trace.is_tracing():
            outputs = self._layer_to_call(*inputs)
        elif trace.tracing_training():
            raise Error(f"CPU ops are only supported in inference graphs: the CPU op "
                        f"{self._ID!r} is called in a trainingModel. Compute it before "
                        "or after the model, or use an inferenceModel.")
        else:
            outputs = self._host.traced(inputs)
        self.in_shapes = [i.shape for i in inputs]
        self.out_shapes = [o.shape for o in (
            outputs if isinstance(outputs, (list, tuple)) else [outputs])]
        return outputs

    def registerPersistentData(self):
        """Allocates zeroed host buffers of the last call's input and output
        shapes (``inputs``, ``outputs``), as PopTorch does for its callback."""
        self.inputs = [torch.zeros(i, device="cpu") for i in self.in_shapes]
        self.outputs = [torch.zeros(o, device="cpu") for o in self.out_shapes]

    def execute(self):
        """Calls the function on ``inputs`` and copies its results into
        ``outputs`` (PopTorch's callback body)."""
        outs = self._layer_to_call(*self.inputs)
        if isinstance(outs, (list, tuple)):
            for persistent_output, output in zip(self.outputs, outs):
                persistent_output.copy_(output)
        else:
            self.outputs[0].copy_(outs)
