"""The engine set up for a compiled program: its generated functions, random
streams and replica groups (``build_engine``), how it runs the optimizer
update (state slots, gradient accumulators, running mean) and whether the
micro-batches of one weight update run as one batched call; the process
group a distributed run sums its gradients in.  Functions of the compiled
program and the engine, called by the executor after a compile and after a
new optimizer rebuilt the update."""
import torch

from ... import enums
from ...machine.batching import batched_graph, serial_reason
from ...machine.call_state import Accumulation
from ...machine.engine import Engine
from . import replica_grouping


def build_engine(compiled, training, options, grouped):
    """The engine of ``compiled``: its functions, sharded state, random
    streams, input groups and replica-grouped weights (``grouped``)."""
    step = next(iter(compiled.program.graphs.values()))
    engine = Engine(compiled.step_fn, compiled.update_fn, shard_index(compiled, training),
                    n_writes=len(step.input_writes))
    engine.streams = step.streams
    engine.input_of = replica_grouping.input_rows(options)
    engine.weight_groups = replica_grouping.engine_groups(compiled, grouped)
    return engine


def process_group(options, training):
    """The gloo group of a distributed training run (``Options.Distributed``),
    or None: inference needs no reduction, and a compile for an offline
    target (``ConnectionType.Never``) runs no step, so each process compiles
    on its own, as in PopTorch."""
    d = options.Distributed
    if d.numProcesses <= 1 or not training \
            or options.connection_type == enums.ConnectionType.Never:
        return None
    from ...distributed import process_group as gloo_group
    return gloo_group(d.processId, d.numProcesses)


def shard_index(compiled, training):
    """{index of a trainable parameter: replicas} for sharded optimizer state."""
    if not training or not compiled.shards:
        return {}
    return {i: compiled.shards[n] for i, n in enumerate(compiled.capture.trainable_names)
            if n in compiled.shards}


def configure_update(engine, compiled):
    """The engine runs the compiled update the way its plan says: state
    slots read and written, gradient accumulators' types, running mean,
    SGD1's accumulation into the velocity."""
    c, e = compiled, engine
    e.update_fn = c.update_fn
    e.shards = shard_index(c, True)
    plan = c.plan
    e.slot_counts = [(len(read), len(written)) for read, written in c.slots]
    into = list(range(len(c.slots))) if plan.into_state else []
    if plan.running_mean or into or any(lay.grad_dtype != lay.dtype for lay in c.layouts):
        e.accumulation = Accumulation([lay.grad_dtype for lay in c.layouts],
                                      plan.running_mean, into)
    else:
        e.accumulation = None


def configure_batching(engine, compiled, training, tapped):
    """The micro-batches of one weight update run as one batched call where
    the training step allows it (``batching.serial_reason``) and no anchor
    taps the step per micro-batch (``tapped``)."""
    c, e = compiled, engine
    step = c.program.graphs[c.program.model_graph]
    e.watch = step.watch if training else None
    if not training or tapped or serial_reason(step) is not None:
        e.batch_fn = None
        return
    # the gradients (summed over the micro-batches) end where the buffers
    # begin; fp32 ones summed at once, others added micro-batch by micro-batch
    stop = len(step.outputs) - sum(t.role == "buffer" for t in step.inputs)
    grads = step.outputs[stop - len(c.capture.trainable_names):stop]
    plain = e.accumulation is None and all(t.dtype == torch.float32 for t in grads)
    acc = e.accumulation
    wide = frozenset() if acc is None or acc.running or acc.into else frozenset(
        t.id for t, d in zip(grads, acc.dtypes) if t.dtype == torch.float16 and d == torch.float32)
    e.batch_fn = batched_graph(step, (stop - len(grads), stop), per_row=not plain, wide=wide)
