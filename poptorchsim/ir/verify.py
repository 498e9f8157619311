"""Checks that a graph is well formed: defined before use, single assignment."""
from ..errors import Error
from .graph import ROLES


def verify_graph(graph):
    defined = set()
    for t in graph.inputs:
        if t.role not in ROLES:
            raise Error(f"IR verifier: input %{t.name} has unknown role {t.role!r}")
        defined.add(t.id)
    for t in graph.tensors:
        if t.role == "const":
            defined.add(t.id)
    for op in graph.ops:
        for t in op.input_tensors():
            if t.id not in defined:
                raise Error(f"IR verifier: {op.name} in graph {graph.name} reads "
                            f"%{t.name} before it is defined")
        if op.cost_class is None:
            raise Error(f"IR verifier: {op.name} has no cost class")
        if op.host_scalar and (op.subgraphs or any(t is None or t.numel > 1
                                                    for t in op.outputs)):
            raise Error(f"IR verifier: {op.name} is marked a host scalar but its results "
                        "are not all scalars")
        for sub in (op.subgraphs or {}).values():
            verify_graph(sub)
            if len(sub.outputs) != len(op.outputs):
                raise Error(f"IR verifier: {op.name}'s sub-graph {sub.name} returns "
                            f"{len(sub.outputs)} tensors for {len(op.outputs)} results")
        for t in op.outputs:
            if t is None:
                continue
            if t.id in defined:
                raise Error(f"IR verifier: %{t.name} is assigned twice")
            if t.producer is not op:
                raise Error(f"IR verifier: %{t.name} does not name {op.name} as producer")
            defined.add(t.id)
    for t in graph.outputs:
        if t.id not in defined:
            raise Error(f"IR verifier: graph {graph.name} returns undefined %{t.name}")
    return graph
