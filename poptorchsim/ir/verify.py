"""Checks the IR: a graph well formed (defined before use, single
assignment), a program's declared fields and control steps.  Passes call
``verify_graph``; with ``passes.manager.VERIFY_EACH_PASS`` the compiler
calls ``verify_program`` after every pass."""
from dataclasses import fields
from typing import Any

from ..errors import Error
from .graph import (
    ROLES,
    AllGather,
    AllReduce,
    Call,
    DeviceToHost,
    Graph,
    HostToDevice,
    Program,
    ReduceScatter,
    RemoteLoad,
    RemoteStore,
    Repeat,
    Sequence,
    Step,
    all_ops,
)
from .kinds import CostClass, Phased, ProgramKind, Role


def verify_graph(graph: Graph) -> Graph:
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


def _declared(obj: Any, what: str) -> None:
    """Raises when a pass set an attribute ``obj``'s class does not declare."""
    extra = set(vars(obj)) - {f.name for f in fields(obj)}
    if extra:
        raise Error(f"IR verifier: {what} has undeclared attribute(s) {sorted(extra)}: "
                    f"declare them as fields of {type(obj).__name__} (ir/graph.py)")


def _check_graph_fields(graph: Graph, program: Program, after: str) -> None:
    _declared(graph, f"graph {graph.name}")
    for t in graph.tensors:
        _declared(t, f"%{t.name}")
        if not isinstance(t.role, Role):
            raise Error(f"IR verifier (after {after}): %{t.name} has role {t.role!r}, not a "
                        "Role (ir/kinds.py)")
    mapped = bool(program.variables)
    for t in graph.inputs:
        if mapped and t.mapping is None:
            raise Error(f"IR verifier (after {after}): input %{t.name} of graph {graph.name} "
                        "has no tile mapping")
    for op in all_ops(graph):
        _declared(op, op.name)
        if not isinstance(op.cost_class, CostClass):
            raise Error(f"IR verifier (after {after}): {op.name} has cost class "
                        f"{op.cost_class!r}, not a CostClass (ir/kinds.py)")
        if not 0 <= op.stage < max(program.n_stages, 1):
            raise Error(f"IR verifier (after {after}): {op.name} is in stage {op.stage} of a "
                        f"program with {program.n_stages} stage(s)")
        if not 0 <= op.ipu < max(program.n_ipus, 1):
            raise Error(f"IR verifier (after {after}): {op.name} runs on IPU {op.ipu} of a "
                        f"program with {program.n_ipus} IPU(s)")
        if op.partials not in ("float", "half"):
            raise Error(f"IR verifier: {op.name} has partials {op.partials!r}")
        if op.recompute and op.backward:
            raise Error(f"IR verifier: backward op {op.name} is marked for recomputation")


_COUNTS = {"device_iteration": "device_iterations", "accumulation": "accumulation"}


def _check_steps(step: Step, program: Program, after: str) -> None:
    where = f"IR verifier (after {after}): control program"
    if isinstance(step, Sequence):
        for s in step.steps:
            _check_steps(s, program, after)
    elif isinstance(step, Repeat):
        want = getattr(program, _COUNTS[step.counter]) if step.counter in _COUNTS else None
        if want is not None and step.count != want:
            raise Error(f"{where}: the {step.counter} loop repeats {step.count} times, the "
                        f"program says {want}")
        _check_steps(step.body, program, after)
    elif isinstance(step, Call):
        if not any(step.graph is g for g in program.graphs.values()):
            raise Error(f"{where}: calls graph {step.graph.name}, which is not the "
                        "program's")
        if step.replicas != program.replicas:
            raise Error(f"{where}: calls {step.graph.name} on {step.replicas} replicas of "
                        f"{program.replicas}")
    elif isinstance(step, (AllReduce, ReduceScatter, AllGather)):
        if step.replicas != program.total_replicas:
            raise Error(f"{where}: a collective over {step.replicas} replicas of "
                        f"{program.total_replicas}")
    elif not isinstance(step, (HostToDevice, DeviceToHost, RemoteLoad, RemoteStore)):
        raise Error(f"{where}: unknown step {type(step).__name__}")


def verify_program(program: Program, after: str = "?") -> Program:
    """Checks a program after the pass ``after``: its graphs well formed,
    every attribute a pass set declared (``Tensor``, ``Op``, ``Graph``,
    ``Program``), stages and IPUs in range, and the control program (when
    built) made of known steps that call the program's own graphs, with
    loop counts and replica counts as the program says."""
    _declared(program, "the program")
    if not isinstance(program.kind, ProgramKind) or not isinstance(program.phased, Phased):
        raise Error(f"IR verifier (after {after}): the program's kind {program.kind!r} or "
                    f"phased {program.phased!r} is not one of ir/kinds.py's names")
    if len(program.ipu_of_stage) != max(program.n_stages, 1):
        raise Error(f"IR verifier (after {after}): {program.n_stages} stage(s) but "
                    f"{len(program.ipu_of_stage)} IPU assignment(s)")
    for graph in program.graphs.values():
        verify_graph(graph)
        _check_graph_fields(graph, program, after)
    if program.main is not None:
        _check_steps(program.main, program, after)
    return program
