"""Readable text for graphs and programs, one line per op; an op holding
sub-graphs (a loop, a conditional) prints them indented under it."""
import torch

from .graph import (FORMATTERS, AllGather, AllReduce, Call, DeviceToHost, HostToDevice,
                    ReduceScatter, RemoteLoad, RemoteStore, Repeat, Sequence, Tensor)

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
        parts.append(f"tiles {mapping.start}..{mapping.start + mapping.n_tiles - 1}")
    if op.backward:
        parts.append("backward")
    if op.recompute:
        parts.append("recomputed")
    if op.partials != "float":
        parts.append(f"{op.partials} partials")
    if op.role:
        parts.append(op.role)
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


def format_program(program):
    lines = [f"program {program.kind} (replicas={program.replicas})"]

    def visit(step, depth):
        pad = "  " * depth
        if isinstance(step, Sequence):
            for s in step.steps:
                visit(s, depth)
        elif isinstance(step, Repeat):
            lines.append(f"{pad}repeat {step.count} ({step.counter}):")
            visit(step.body, depth + 1)
        elif isinstance(step, Call):
            lines.append(f"{pad}call {step.graph.name} on {step.replicas} replica(s) "
                         f"[{len(step.graph.ops)} ops]")
        elif isinstance(step, HostToDevice):
            lines.append(f"{pad}stream host->device {step.nbytes} B")
        elif isinstance(step, DeviceToHost):
            lines.append(f"{pad}stream device->host {step.nbytes} B ({step.mode})")
        elif isinstance(step, AllReduce):
            lines.append(f"{pad}all-reduce {step.nbytes} B across {step.replicas} replicas")
        elif isinstance(step, ReduceScatter):
            lines.append(f"{pad}reduce-scatter {step.nbytes} B across {step.replicas} replicas")
        elif isinstance(step, AllGather):
            lines.append(f"{pad}all-gather {step.nbytes} B across {step.replicas} replicas")
        elif isinstance(step, (RemoteLoad, RemoteStore)):
            verb = "load from" if isinstance(step, RemoteLoad) else "store to"
            names = ", ".join(step.names[:3]) + (", ..." if len(step.names) > 3 else "")
            how = (" via IO tiles" if step.io_tiles else "") + (
                f" (phased, {step.transfers} transfer(s))" if step.phased else "")
            lines.append(f"{pad}{verb} Streaming Memory {step.nbytes} B per replica{how} "
                         f"({names})")
    visit(program.main, 1)
    text = "\n".join(lines)
    for graph in program.graphs.values():
        text += "\n\n" + format_graph(graph)
    return text


FORMATTERS["graph"] = format_graph
FORMATTERS["program"] = format_program
