"""The cycle estimate of a call: a walk over ``Program.main``.

The engine runs a program by walking its control steps
(``machine/engine.py``); the estimate walks the same steps and charges
each one by its rule below, so what ``getIR()`` prints is what runs and what
is charged.  A step inside ``Repeat`` loops is charged once per iteration of
every loop around it.

=============== ============================================================
step            cycles
=============== ============================================================
Repeat          its body, ``count`` times.  The loop whose body calls the
                model's graph (training: the accumulation loop; inference:
                the device-iteration loop) runs its iterations as one
                pipeline schedule (``estimate/schedule.py``) over the
                stages' forward and backward cycles; the accumulation loop
                also adds every gradient into its accumulator once per
                micro-batch (one vector pass and a sync)
Call            the graph's ops (``estimate/cost.op_cost``, summed by kind);
                the optimizer update runs on every IPU holding parameters at
                once, so its cycles are shared among them
AllReduce       a ring over IPU-Links, two phases (reduce-scatter then
                all-gather) of R-1 steps; each IPU of a replica reduces its
                own share of the bytes at the same time
ReduceScatter,  a ring, one phase
AllGather
RemoteLoad,     Streaming Memory: bytes over the IPU-Machine's gateway, which
RemoteStore     every IPU in use shares, plus a latency per transfer.
                Through IO tiles the transfer overlaps compute (only what
                compute cannot hide is paid) and the data then crosses the
                exchange to the compute tiles.  Phased execution's loads
                overlap the other phase's compute in parallel phases
HostToDevice,   PCIe: a latency per copy plus bytes at the host link's rate,
DeviceToHost    less what overlapped IO or the sync pattern hides
=============== ============================================================
"""
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..ir.graph import Call, Repeat, Sequence
from ..ir.kinds import Counter
from ..ir.visitor import StepVisitor
from . import constants as K
from .cost import exchange_cycles, op_cost
from .schedule import Schedule, schedule

KINDS = ("compute", "exchange", "sync", "host")      # an op's cycles (host: host ops' trips)


def graph_cycles(costs):
    """The cycles of a graph's ops (``OpCost`` list), summed by kind."""
    return {k: float(sum(getattr(c, k) for c in costs)) for k in KINDS}


def link_cycles(nbytes, src, dst, target):
    """An inter-IPU copy: bytes over one IPU-Link plus a sync that grows with
    the hops between the IPUs (PopLibs' global-sync model, 15 ns a hop)."""
    hops = 1 + abs(dst - src) // 2
    sync = int(np.ceil(K.LINK_HOP_SECONDS * target.clock_hz * hops * 2))
    return nbytes / (target.link_bytes_per_s / target.clock_hz) + sync


def stage_times(graph, costs, target, n_stages):
    """(forward, backward) cycles per stage for one micro-batch, inter-IPU
    copies included (charged to the receiving stage); recomputed ops run
    again before their stage's backward."""
    fwd, bwd = [0.0] * n_stages, [0.0] * n_stages
    ipu_of = {}
    for op, cost in zip(graph.ops, costs):
        (bwd if op.backward else fwd)[op.stage] += cost.total
        if op.recompute:
            bwd[op.stage] += cost.total
        for t in op.outputs:
            if t is not None:
                ipu_of[t.id] = op.ipu
    copied = set()
    for op in graph.ops:
        for t in op.input_tensors():
            src = ipu_of.get(t.id, t.mapping.ipu)
            if src != op.ipu and (t.id, op.ipu) not in copied:
                copied.add((t.id, op.ipu))
                (bwd if op.backward else fwd)[op.stage] += link_cycles(
                    t.nbytes, src, op.ipu, target)
    return fwd, bwd


def ring_cycles(nbytes, replicas, phases, target):
    """A ring collective over IPU-Links: ``phases`` = 2 for an all-reduce,
    1 for a reduce-scatter or an all-gather.  Each of the (R-1) steps of a
    phase moves 1/R of the tensor over one link and syncs."""
    if replicas <= 1 or nbytes <= 0:
        return 0.0
    link_bytes_per_cycle = target.link_bytes_per_s / target.clock_hz
    steps = phases * (replicas - 1)
    return steps * (nbytes / replicas / link_bytes_per_cycle + K.RING_STEP_SYNC_CYCLES)


def streaming_cycles(nbytes, transfers, program, target):
    """Moving ``nbytes`` between one replica's tiles and Streaming Memory in
    ``transfers`` separate copies, while every IPU of the IPU-Machine does
    the same (they share its gateway)."""
    if nbytes <= 0 and transfers <= 0:
        return 0.0
    sharing = min(target.ipus_per_machine, program.n_ipus * program.total_replicas)
    seconds = nbytes * sharing / target.streaming_bytes_per_s + transfers * target.host_latency_s
    return seconds * target.clock_hz


@dataclass
class _Charges:
    """What a walk over the control program has charged so far."""
    kinds: dict = field(default_factory=lambda: dict.fromkeys(
        KINDS + ("collective", "streaming"), 0.0))
    through_io: float = 0.0        # Streaming Memory through IO tiles (overlaps compute)
    phased: float = 0.0            # phased execution's Streaming Memory traffic
    streams: dict = field(default_factory=dict)    # overlap mode -> host stream seconds
    recomputed: float = 0.0
    schedule: Optional[Schedule] = None   # the model loop's, once charged


class _Walk(StepVisitor):
    """The estimate's walk: each control step charged by its kind's rule."""

    def __init__(self, program, costs, target):
        super().__init__()
        self.program, self.costs, self.target = program, costs, target
        self.training = program.kind == "training"
        self.model = program.graphs[program.model_graph]
        self.ipus = max(len(set(program.ipu_of_stage)), 1)   # IPUs holding parameters
        self.n_ipus = max(program.n_ipus, 1)
        self.charges = _Charges()
        self.loop = None         # (the loop whose body calls the model, its own repeats)

    def charge(self, kind, cycles):
        self.charges.kinds[kind] += cycles

    def step(self, step, times):
        """Charges ``step``, run ``times`` times."""
        self.visit(step, times)

    def _Sequence(self, step, times):
        for s in step.steps:
            self.step(s, times)

    def _Repeat(self, step, times):
        inner = step.body.steps if isinstance(step.body, Sequence) else [step.body]
        if any(isinstance(s, Call) and s.graph is self.model for s in inner):
            # the loop whose body calls the model: the call charges the
            # pipeline schedule over the loop's iterations (``_Call``)
            outer, self.loop = self.loop, (step, times)
            self.step(step.body, times * step.count)
            self.loop = outer
        else:
            self.step(step.body, times * step.count)

    def _pipeline(self, loop, times):
        """The model's graph over the loop's iterations, as one pipeline schedule."""
        program, target = self.program, self.target
        costs = self.costs[program.model_graph]
        again = [c for op, c in zip(self.model.ops, costs) if op.recompute]
        kinds = graph_cycles(costs + again)
        fwd, bwd = stage_times(self.model, costs, target, program.n_stages)
        sched = schedule(fwd, bwd, program.ipu_of_stage, loop.count, program.pipelined,
                         self.training)
        self.charges.schedule = sched
        whole = sum(kinds.values()) or 1.0
        for k, v in kinds.items():
            self.charge(k, sched.cycles * times * v / whole)
        self.charges.recomputed += sched.cycles * times * sum(c.total for c in again) / whole
        if loop.counter == "accumulation" and loop.count > 1:
            # accumulate: one element-wise add of every gradient per micro-batch
            per_tile = program.grad_bytes / target.tiles / self.ipus
            self.charge("compute", times * loop.count * (per_tile / target.vector_bytes))
            self.charge("sync", times * loop.count * target.sync_cycles)

    def _Call(self, step, times):
        if step.graph is self.model:          # outside a loop: a pipeline of one
            loop, loop_times = self.loop or (Repeat(1, step, Counter.CALL), times)
            self._pipeline(loop, loop_times)
            return
        for k, v in graph_cycles(self.costs[step.graph.name]).items():
            self.charge(k, v * times / self.ipus)

    def _collective(self, step, times, phases):
        self.charge("collective", times * ring_cycles(
            step.nbytes / self.n_ipus, step.replicas, phases, self.target))

    def _AllReduce(self, step, times):
        self._collective(step, times, 2)

    def _ReduceScatter(self, step, times):
        self._collective(step, times, 1)

    def _AllGather(self, step, times):
        self._collective(step, times, 1)

    def _remote(self, step, times):
        program, target = self.program, self.target
        nbytes = step.nbytes / self.n_ipus
        if step.phased:
            self.charges.phased += streaming_cycles(
                times * nbytes, times * step.transfers / self.n_ipus, program, target)
        elif step.io_tiles:
            # the IO tiles hold the transfer while compute goes on; the data
            # then crosses the exchange from IO to compute tiles
            self.charges.through_io += streaming_cycles(
                nbytes * times, step.transfers * times, program, target)
            self.charge("streaming", times * exchange_cycles(
                nbytes / max(target.io_tiles, 1), target))
        else:
            self.charge("streaming", streaming_cycles(
                nbytes * times, step.transfers * times, program, target))

    def _RemoteLoad(self, step, times):
        self._remote(step, times)

    def _RemoteStore(self, step, times):
        self._remote(step, times)

    def _stream(self, step, times):
        if self.program.synthetic_data:
            return
        target = self.target
        for mode, copies, nbytes in step.streams:
            seconds = (copies * times * target.host_latency_s
                       + nbytes * times / target.host_bytes_per_s)
            self.charges.streams[mode] = self.charges.streams.get(mode, 0.0) + seconds

    def _HostToDevice(self, step, times):
        self._stream(step, times)

    def _DeviceToHost(self, step, times):
        self._stream(step, times)


def estimate(program, costs, target):
    """(cycles of one call split by kind, the pipeline ``Schedule`` of one
    weight update) for ``program`` with per-op ``costs`` (graph name ->
    [OpCost])."""
    walk = _Walk(program, costs, target)
    walk.step(program.main, 1)
    charges = walk.charges
    total = charges.kinds
    if charges.through_io:      # Streaming Memory transfers through IO tiles overlap compute
        device = total["compute"] + total["exchange"] + total["sync"]
        total["streaming"] += max(0.0, charges.through_io - device)
    if program.phased:
        device = total["compute"] + total["exchange"] + total["sync"]
        cycles = charges.phased
        if program.phased == "parallel":   # the next phase loads while this one computes
            n_phases = max(program.phase_of_stage) + 1
            cycles = max(cycles / n_phases, cycles - device)
        total["streaming"] += cycles
    host_s = target.call_overhead_s
    if not program.synthetic_data:
        device_s = sum(total.values()) / target.clock_hz
        streams_s = _host_seconds(charges.streams, device_s, program)
        host_s += _unsynced_host_seconds(program, charges.schedule, streams_s, device_s)
    total["host"] += host_s * target.clock_hz       # streams, after host ops' trips
    total["total"] = sum(total.values())
    total["seconds"] = total["total"] / target.clock_hz
    assert charges.schedule is not None, "every program calls its model graph"
    total["bubble"] = charges.schedule.bubble
    total["recompute"] = charges.recomputed       # part of "total", not added to it
    return total, charges.schedule


def _host_seconds(by_mode, device_s, program):
    """Seconds the host streams of one call add to it.  A stream through the
    IO tiles (``set_overlap_for_input``/``_output``) runs while the compute
    tiles work: only what compute cannot hide is paid, and at least its first
    copy of each loop it overlaps (the accumulation loop, once per device
    iteration; or the whole device-iteration loop)."""
    di, ga = program.device_iterations, program.accumulation
    plain = by_mode.get("no_overlap", 0.0)
    overlapped = 0.0
    for mode, seconds in by_mode.items():
        if mode == "no_overlap":
            continue
        windows, steps = (1, di * ga) if mode == "overlap_device_iteration_loop" else (di, ga)
        per_window, compute = seconds / windows, device_s / windows
        overlapped += windows * max(per_window / steps, per_window - compute)
    return plain + overlapped


def _unsynced_host_seconds(program, sched, streams_s, device_s):
    """The host streams' seconds left to pay under ``Options.syncPattern``.

    ``Full``: every host transfer syncs all IPUs, which wait for it: all of
    it is paid.  ``SinglePipeline``: the IPUs that stream (the first stage's
    for inputs, the last stage's for outputs) sync with the host alone, so
    the transfer fills their idle time in the schedule while the other IPUs
    compute; only what that idle time cannot hold is paid (a replica on one
    IPU has none).  ``ReplicaAndLadder``: replicas stream without syncing
    each other, so each replica's transfer overlaps the others' compute; the
    host link still carries all of it (at least ``streams_s`` in all, at
    least one replica's share on the critical path)."""
    pattern = program.sync_pattern
    if pattern == "SinglePipeline" and program.n_ipus > 1 and sched is not None:
        busy: dict[int, float] = {}
        for ipu, _, _, duration in sched.events:
            busy[ipu] = busy.get(ipu, 0.0) + duration
        io_ipus = {program.ipu_of_stage[0], program.ipu_of_stage[-1]}
        share = max(busy.get(i, 0.0) for i in io_ipus) / (sched.cycles or 1.0)
        idle_s = device_s * max(0.0, 1.0 - min(share, 1.0))
        return max(0.0, streams_s - idle_s)
    replicas = program.total_replicas
    if pattern == "ReplicaAndLadder" and replicas > 1:
        return max(streams_s / replicas, streams_s - device_s)
    return streams_s


def op_costs(program, target, amp):
    """An ``OpCost`` per op of every graph (``amp``: the available memory
    proportion, or {IPU: proportion}, 0.6 where unset); each convolution's
    and matmul's ``Op.plan`` is set from its cost, for ``getIR()``."""
    costs = {}
    for name, graph in program.graphs.items():
        costs[name] = [op_cost(op, target, amp.get(op.ipu, 0.6) if isinstance(amp, dict)
                               else amp) for op in graph.ops]
        for op, cost in zip(graph.ops, costs[name]):
            op.plan = cost.plan
    return costs
