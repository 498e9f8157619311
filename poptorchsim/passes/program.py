"""The control program of a call, built from the placed and mapped graphs.

``build_main(program)`` returns the program with ``main`` set: the loops,
graph calls, collectives, Streaming Memory transfers and host streams of one
call, in the order Poplar runs them.  The engine executes exactly this tree
(``machine/engine.py``) and the estimate charges exactly this tree
(``estimate/program_cost.py``).

Training, per device iteration (one weight update)::

    stream host->device                    the iteration's micro-batches
    repeat accumulation:
        load weights / accumulators        off-chip ones (Streaming Memory)
        all-gather sharded weights         replicated tensor sharding
        call training_step                 every replica
        store accumulators                 off-chip ones
    all-reduce gradients                   across all replicas
    reduce-scatter gradients               those with sharded optimizer state
    load optimizer state                   off-chip
    call optimizer_update
    store optimizer state
    all-gather sharded weights             after the sharded update
    store weights                          off-chip
    stream device->host                    as the output mode asks

Inference, per device iteration: the input stream, off-chip weights loaded
and sharded weights gathered, the forward call, the output stream.  Phased
execution adds each phase's weight (and, at the update, optimizer state)
traffic, and the activations that cross phases when they wait off chip.
"""
from dataclasses import replace

from ..ir.graph import (
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
    Step,
)
from ..ir.kinds import Counter
from .memory import variable_phases


def gradient_bytes(program):
    """(all-reduced, reduce-scattered) gradient bytes of one weight update:
    gradients of parameters with sharded optimizer state are reduce-scattered."""
    grads = [t for t in program.graphs["optimizer_update"].inputs if t.role == "accumulator"]
    sharded = sum(t.mapping.nbytes for t in grads
                  if t.name.split("/", 1)[1] in program.sharded_state)
    return sum(t.mapping.nbytes for t in grads) - sharded, sharded


def _off_chip(program, kind):
    """[(names, bytes per replica, through IO tiles)] of the ``kind``
    variables kept in Streaming Memory, one entry per way they travel."""
    found = []
    for io in (False, True):
        names = [n for n, loc in program.locations.items()
                 if loc.kind == kind and loc.off_chip and loc.io_tiles == io]
        if names:
            found.append((names, sum(program.locations[n].replica_bytes for n in names), io))
    return found


def _loads(program, kind):
    return [RemoteLoad(names, nbytes, io) for names, nbytes, io in _off_chip(program, kind)]


def _stores(program, kind):
    return [RemoteStore(names, nbytes, io) for names, nbytes, io in _off_chip(program, kind)]


def _sequence(steps):
    return steps[0] if len(steps) == 1 else Sequence(steps)


def _per_iteration(streams, di):
    """Host streams of one device iteration, from those of the whole call."""
    return [(mode, copies / di, nbytes / di) for mode, copies, nbytes in streams]


def build_main(program):
    """``program`` with its control program (``main``) and the gradient bytes
    reduced per weight update (``grad_bytes``) set."""
    di, R = program.device_iterations, program.total_replicas
    training = program.kind == "training"
    model = program.graphs[program.model_graph]
    micro = _loads(program, "weight")
    rts_weights = sum(loc.nbytes for loc in program.locations.values()
                      if loc.kind == "weight" and loc.sharded)
    if rts_weights:
        micro.append(AllGather(rts_weights, R))
    phases = _phase_traffic(program) if program.phased else None
    if phases:
        micro += phases["micro"]
    whole = sharded = 0
    if training:
        micro += _loads(program, "accumulator")
    micro.append(Call(model, program.replicas))
    if training:
        micro += _stores(program, "accumulator")
        whole, sharded = gradient_bytes(program)
    body: list[Step] = [HostToDevice(program.in_bytes // di,
                                     _per_iteration(program.in_streams, di))]
    if training:
        body.append(Repeat(program.accumulation, _sequence(micro), Counter.ACCUMULATION))
        if R > 1 and whole:
            body.append(AllReduce(whole, R))
        if R > 1 and sharded:
            body.append(ReduceScatter(sharded, R))
        body += _loads(program, "optimizer")
        body.append(Call(program.graphs["optimizer_update"], program.replicas))
        body += _stores(program, "optimizer")
        if R > 1 and sharded:
            body.append(AllGather(sharded, R))
        body += _stores(program, "weight")
        if phases:
            body += phases["update"]
    else:
        body += micro
    body.append(DeviceToHost(program.out_bytes // max(di, 1), "per output mode",
                             _per_iteration(program.out_streams, di)))
    main = Repeat(di, Sequence(body), Counter.DEVICE_ITERATION)
    return replace(program, main=main, grad_bytes=whole + sharded)


def _phase_traffic(program):
    """Phased execution's Streaming Memory steps: {"micro": per micro-batch,
    "update": per weight update}.  Each phase loads its weights before it
    runs (again for the backward pass), activations that cross phases are
    stored and loaded when they wait off chip, and at the update each phase
    stores its weights and loads and stores its optimizer state.  Every IPU
    moves its own phases' tensors (the cost divides the transfers among the
    IPUs)."""
    training = program.kind == "training"
    step = program.graphs[program.model_graph]
    locs = program.locations
    phases = variable_phases(program)
    n_phases = max(program.phase_of_stage) + 1

    def replica_bytes(t):
        loc = locs.get(t.name)
        return loc.replica_bytes if loc else t.mapping.nbytes

    weights = [t for t in step.inputs if t.role in ("param", "buffer") and t.name in phases]
    state = [t for g in list(program.graphs.values())[1:] for t in g.inputs
             if t.role in ("state", "accumulator") and t.name in phases]
    w_names, w_bytes = [t.name for t in weights], sum(replica_bytes(t) for t in weights)
    s_names, s_bytes = [t.name for t in state], sum(replica_bytes(t) for t in state)
    crossing = []
    if program.activations_off_chip:
        phase_of_op = {}
        for op in step.ops:
            for t in op.outputs:
                if t is not None:
                    phase_of_op[t.id] = program.phase_of_stage[op.stage]
        seen = set()
        for op in step.ops:
            here = program.phase_of_stage[op.stage]
            for t in op.input_tensors():
                if phase_of_op.get(t.id, here) != here and t.id not in seen:
                    seen.add(t.id)
                    crossing.append(t)
    c_names, c_bytes = [t.name for t in crossing], sum(t.nbytes for t in crossing)

    def load(names, nbytes, transfers):
        return RemoteLoad(names, nbytes, False, transfers, True)

    def store(names, nbytes, transfers):
        return RemoteStore(names, nbytes, False, transfers, True)

    micro = [load(w_names, w_bytes, n_phases)]
    if training:
        micro.append(load(w_names, w_bytes, n_phases))      # again for the backward pass
    if crossing:
        micro += [store(c_names, c_bytes, 0), load(c_names, c_bytes, 0)]
    update = ([store(w_names, w_bytes, n_phases), load(s_names, s_bytes, n_phases),
               store(s_names, s_bytes, n_phases)] if training else [])
    return {"micro": micro, "update": update}
