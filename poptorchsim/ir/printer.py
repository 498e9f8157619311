"""Readable text for graphs and programs, one line per op; an op holding
sub-graphs (a loop, a conditional) prints them indented under it."""
import torch

from .graph import (
    FORMATTERS,
    AllGather,
    AllReduce,
    Call,
    DeviceToHost,
    HostToDevice,
    ReduceScatter,
    RemoteLoad,
    RemoteStore,
    Repeat,
    Sequence,
    Tensor,
)

_DTYPES = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16",
           torch.int64: "i64", torch.int32: "i32", torch.bool: "bool",
           torch.uint8: "u8", torch.int8: "i8", torch.bfloat16: "bf16"}


def type_str(t):
    return f"{_DTYPES.get(t.dtype, str(t.dtype))}[{','.join(map(str, t.shape))}]"


def _arg(x):
    if isinstance(x, Tensor):
        return f"%{x.name}"
    if isinstance(x, (list, tuple)):
        inner = ", ".join(_arg(y) for y in x)
        return f"[{inner}]"
    return repr(x)


def _placed(op):
    """Where an op runs and what passes decided for it: stage, IPU, the
    tiles of its result, recomputation, fp16 partials, its role."""
    parts = [f"stage {op.stage}", f"ipu {op.ipu}"]
    mapping = next((t.mapping for t in op.outputs if t is not None and t.mapping is not None),
                   None)
    if mapping is not None:
        parts.append(f"{mapping.n_tiles} tile(s) from {mapping.start}")
    if op.backward:
        parts.append("backward")
    if op.recompute:
        parts.append("recomputed")
    if op.partials != "float":
        parts.append(f"{op.partials} partials")
    if op.role:
        parts.append(op.role)
    if op.plan:
        parts.append(f"plan {op.plan}")
    return ", ".join(parts)


def format_graph(graph, indent=""):
    lines = [f"{indent}graph {graph.name}("]
    for t in graph.inputs:
        lines.append(f"{indent}    %{t.name}: {type_str(t)}  # {t.role}")
    lines.append(f"{indent}):")
    for op in graph.ops:
        outs = ", ".join(f"%{t.name}: {type_str(t)}" if t is not None else "_"
                         for t in op.outputs)
        args = ", ".join(_arg(a) for a in op.args)
        if op.kwargs:
            args += ", " + ", ".join(f"{k}={_arg(v)}" for k, v in op.kwargs.items())
        attrs = "".join(f", {k}={v!r}" for k, v in op.attrs.items())
        what = op.cost_class + (", host scalar" if op.host_scalar else "")   # passes/host_scalars
        lines.append(f"{indent}  {outs} = {op.target}({args}{attrs})  # {what}; {_placed(op)}")
        for sub in (op.subgraphs or {}).values():
            lines.append(format_graph(sub, indent + "    "))
    lines.append(f"{indent}  return {_arg(list(graph.outputs))}")
    return "\n".join(lines)


def format_step(step):
    """One line for a control step (``Sequence`` and ``Repeat`` frame others)."""
    if isinstance(step, Repeat):
        return f"repeat {step.count} ({step.counter}):"
    if isinstance(step, Call):
        return (f"call {step.graph.name} on {step.replicas} replica(s) "
                f"[{len(step.graph.ops)} ops]")
    if isinstance(step, HostToDevice):
        return f"stream host->device {step.nbytes} B"
    if isinstance(step, DeviceToHost):
        return f"stream device->host {step.nbytes} B ({step.mode})"
    if isinstance(step, AllReduce):
        return f"all-reduce {step.nbytes} B across {step.replicas} replicas"
    if isinstance(step, ReduceScatter):
        return f"reduce-scatter {step.nbytes} B across {step.replicas} replicas"
    if isinstance(step, AllGather):
        return f"all-gather {step.nbytes} B across {step.replicas} replicas"
    if isinstance(step, (RemoteLoad, RemoteStore)):
        verb = "load from" if isinstance(step, RemoteLoad) else "store to"
        names = ", ".join(step.names[:3]) + (", ..." if len(step.names) > 3 else "")
        how = (" via IO tiles" if step.io_tiles else "") + (
            f" (phased, {step.transfers} transfer(s))" if step.phased else "")
        return f"{verb} Streaming Memory {step.nbytes} B per replica{how} ({names})"
    raise TypeError(f"unknown program step {type(step).__name__}")


def format_program(program):
    lines = [f"program {program.kind} (replicas={program.replicas})"]

    def visit(step, depth):
        if isinstance(step, Sequence):
            for s in step.steps:
                visit(s, depth)
            return
        lines.append("  " * depth + format_step(step))
        if isinstance(step, Repeat):
            visit(step.body, depth + 1)
    if program.main is not None:
        visit(program.main, 1)
    text = "\n".join(lines)
    for graph in program.graphs.values():
        text += "\n\n" + format_graph(graph)
    return text


FORMATTERS["graph"] = format_graph
FORMATTERS["program"] = format_program
