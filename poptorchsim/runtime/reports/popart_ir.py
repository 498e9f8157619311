"""``_debugGetPopartIR()``: the compiled program in the form of PopART's
serialised IR.

PopTorch's ``_debugGetPopartIR()`` returns PopART's IR as JSON,
``{"maingraph": [op, ...]}``, each op with its ``type``, ``name``,
``domain``, ``attributes``, ``inputs`` and ``outputs`` (tensors: ``name``,
``shape``, ``type``); programs and PopTorch's tests count the ops of a type
in it.  poptorchsim writes its own IR (what ``getIR()`` prints, what the
engine runs and the estimate charges) in that form:

* each op of the model's graph (the training step or the inference
  forward), typed by the ONNX or PopART operator PopTorch lowers its ATen
  operator to (``_TYPES``; an operator not listed takes its ATen name in
  PopART's CamelCase), named ``<name scope>/<type>:<n>``, and its
  ``available_memory_proportion``, ``partials_type`` and a reduction's
  ``reduction``, ``group_size`` (1) and ``dim`` as attributes;
* the convolutions of one ``poptorch.MultiConv`` as one ``MultiConv`` op;
* in training, each trainable weight's optimizer update as the ops PopART
  gives it (``SGD0VarUpdate`` for SGD without momentum; ``SGD1AcclUpdate``
  and ``SGD1VarUpdate`` for SGD's combined variant; ``AdamUpdater`` and
  ``AdamVarUpdate`` for Adam, AdamW and RMSprop's adaptive rule, LAMB adding
  two ``LambSquare``; ``SGD2VarUpdate`` for SGD's separate variant).

PopART's own transformations (its patterns, inplacing, outlining, the
grouping of scatters) are not applied: the ops are poptorchsim's."""
import json
from collections import Counter

import torch

# ATen operator (its OpOverloadPacket name) -> the ONNX / PopART operator type
_TYPES = {
    "mm": "MatMul", "bmm": "MatMul", "addmm": "MatMul", "matmul": "MatMul",
    "linear": "MatMul", "baddbmm": "MatMul", "addbmm": "MatMul", "mv": "MatMul",
    "convolution": "Conv", "convolution_backward": "ConvFlipWeights",
    "relu": "Relu", "gelu": "Gelu", "sigmoid": "Sigmoid", "tanh": "Tanh", "exp": "Exp",
    "log": "Log", "sqrt": "Sqrt", "rsqrt": "Rsqrt", "neg": "Neg", "abs": "Abs",
    "add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "pow": "Pow",
    "max_pool2d_with_indices": "MaxPool", "max_pool1d": "MaxPool", "max_pool2d": "MaxPool",
    "avg_pool2d": "AveragePool", "avg_pool1d": "AveragePool",
    "adaptive_avg_pool2d": "AveragePool", "_adaptive_avg_pool2d": "AveragePool",
    "_log_softmax": "LogSoftmax", "_softmax": "Softmax",
    "native_batch_norm": "BatchNormalization",
    "_native_batch_norm_legit_no_training": "BatchNormalization",
    "_native_batch_norm_legit_functional": "BatchNormalization",
    "native_layer_norm": "GroupNormalization", "native_group_norm": "GroupNormalization",
    "scatter_reduce": "ScatterReduce", "scatter_add": "ScatterReduce",
    "index_reduce": "ScatterReduce", "scatter": "Scatter",
    "gather": "Gather", "index_select": "Gather", "embedding": "Gather",
    "view": "Reshape", "_unsafe_view": "Reshape", "reshape": "Reshape",
    "permute": "Transpose", "t": "Transpose", "transpose": "Transpose",
    "cat": "Concat", "slice": "Slice", "expand": "Expand", "where": "Where",
    "clone": "Identity", "_to_copy": "Cast", "sum": "ReduceSum", "mean": "ReduceMean",
    "amax": "ReduceMax", "amin": "ReduceMin", "nll_loss_forward": "Nll",
    "squeeze": "Squeeze", "unsqueeze": "Unsqueeze", "constant_pad_nd": "Pad",
}

# the optimizer update's ops per trainable weight, by the update's rule
_UPDATE_OPS = {
    "sgd": ("SGD2VarUpdate",),
    "sgd_combined": ("SGD1AcclUpdate", "SGD1VarUpdate"),
    "adam": ("AdamUpdater", "AdamVarUpdate"),
    "adamw": ("AdamUpdater", "AdamVarUpdate"),
    "rmsprop": ("AdamUpdater", "AdamVarUpdate"),
    "lamb": ("AdamUpdater", "LambSquare", "LambSquare", "AdamVarUpdate"),
}

_DTYPES = {torch.float32: "FLOAT", torch.float16: "FLOAT16", torch.bfloat16: "BFLOAT16",
           torch.int64: "INT64", torch.int32: "INT32", torch.bool: "BOOL",
           torch.int8: "INT8", torch.uint8: "UINT8", torch.float64: "DOUBLE"}


def _camel(name):
    return "".join(part[:1].upper() + part[1:] for part in name.strip("_").split("_"))


def op_type(op):
    """The PopART operator type of an IR op."""
    packet = getattr(op.target, "overloadpacket", None)
    name = getattr(packet, "__name__", None) or getattr(op.target, "__name__", str(op.target))
    return _TYPES.get(name) or _camel(name)


def _tensor(t):
    return {"name": t.name, "shape": [str(s) for s in t.shape],
            "type": _DTYPES.get(t.dtype, str(t.dtype).replace("torch.", "").upper())}


def _attributes(op):
    out = {}
    if op.available_memory is not None:
        out["available_memory_proportion"] = str(op.available_memory)
    if op.cost_class in ("matmul", "conv"):
        out["partials_type"] = "HALF" if op.partials == "half" else "FLOAT"
    packet = getattr(getattr(op.target, "overloadpacket", None), "__name__", "")
    if packet in ("scatter_reduce", "scatter_add", "index_reduce"):
        reduce = "sum" if packet == "scatter_add" else next(
            (a for a in op.args if isinstance(a, str)), op.kwargs.get("reduce", "sum"))
        out.update(reduction=str(reduce), group_size="1",
                   axis=str(op.args[1] if len(op.args) > 1 else 0))
    return out


def _scoped(op, kind, counts):
    scope = op.name.rpartition("/")[0]
    k = counts[kind]
    counts[kind] += 1
    return f"{scope + '/' if scope else ''}{kind}:{k}"


def popart_ir(compiled):
    """The JSON text of ``compiled``'s program in PopART's serialised form."""
    program = compiled.program
    graph = program.graphs[program.model_graph]
    ops, counts, groups = [], Counter(), {}
    for op in graph.ops:
        group = op.attrs.get("multiconv")
        key = group if isinstance(group, (int, str, tuple)) else id(group)
        if group is not None:                   # one MultiConv per group
            if key in groups:
                entry = groups[key]
                entry["inputs"] += [_tensor(t) for t in op.input_tensors()]
                entry["outputs"] += [_tensor(t) for t in op.outputs if t is not None]
                continue
            kind = "MultiConv"
        else:
            kind = op_type(op)
        entry = {"type": kind, "name": _scoped(op, kind, counts),
                 "domain": "ai.graphcore" if kind == "MultiConv" else "ai.onnx",
                 "attributes": _attributes(op),
                 "inputs": [_tensor(t) for t in op.input_tensors()],
                 "outputs": [_tensor(t) for t in op.outputs if t is not None]}
        if group is not None:
            groups[key] = entry
        ops.append(entry)
    if program.kind == "training" and compiled.plan is not None:
        ops += _update_ops(compiled, program, counts)
    return json.dumps({"maingraph": ops})


def _update_ops(compiled, program, counts):
    """Each trainable weight's optimizer ops, as PopART names them."""
    plan = compiled.plan
    params = [t for t in program.graphs["optimizer_update"].inputs if t.role == "param"]
    out = []
    for t, group in zip(params, compiled.group_of):
        kinds = _UPDATE_OPS.get(plan.kind, ("VarUpdate",))
        if plan.kind in ("sgd", "sgd_combined") and not plan.group_flags(group).get("momentum"):
            kinds = ("SGD0VarUpdate",)      # PopART's SGD without momentum
        for kind in kinds:
            k = counts[kind]
            counts[kind] += 1
            out.append({"type": kind, "name": f"{kind}:{k}", "domain": "ai.graphcore",
                        "attributes": {}, "inputs": [_tensor(t)],
                        "outputs": [{**_tensor(t), "name": f"UpdatedVar___{t.name}"}]})
    return out
