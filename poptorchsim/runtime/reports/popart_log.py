"""PopTorch's debug log of a compile, written from poptorchsim's IR.

With ``POPTORCH_LOG_LEVEL=DEBUG`` PopTorch's backend logs how it lowered
the model: the session options it sets where the user did not
(``enablePipelining set to value 1`` when a pipelined model uses more than
one IPU, ``0`` otherwise), then ``Graph lowered to PopART {``, a line per
operation, ``<operation> was lowered to <its tensors> [<types>, mode(Pipelined),
ipu(I), stage(S)]`` (``mode(Sharded)``; ``mode(Phased), ipu(I), phase(P)``),
and ``}``.  Programs and PopTorch's tests read these lines to see where
each operation runs.  poptorchsim writes them from the compiled program,
for the forward operations of the model's graph (PopART differentiates the
rest): the tensors named as PopART names them (``<name scope>/<type>:<output>``,
``/1``, ``/2`` ... after a name already taken; types as in
``_debugGetPopartIR()``), the IPU and stage (or phase) the placement gave.
Nothing is computed when the log is not at debug level."""
import logging

from ...passes.pipeline import has_default_block
from .popart_ir import op_type


def _mode(spec):
    if getattr(spec, "phased", False):
        return "Phased"
    return "Pipelined" if spec is None or spec.pipelined else "Sharded"


def _phase_scale(spec):
    """PopART's phase of the user's phase 1: serial phases whose activations
    go off chip after each phase take 4 of PopART's, without overlap 2."""
    return {"OffChipAfterEachPhase": 4, "OffChipAfterFwdNoOverlap": 2}.get(
        getattr(spec, "liveness", "AlwaysLive"), 1)


def _phased_settings(program, spec, locations, log):
    """The session options PopTorch sets for phased execution where the
    user did not: the phases (three more when activations go off chip
    between them), the stages per phase, and every kind of variable in
    Streaming Memory."""
    phases = max(program.phase_of_stage or [0]) * _phase_scale(spec) + 1
    if getattr(spec, "liveness", "AlwaysLive") != "AlwaysLive":
        phases += 3
    log.debug("executionPhaseSettings.phases set to value %d", phases)
    log.debug("executionPhaseSettings.stages set to value %d", 1 if spec.serial else 2)
    for kind in ("activation", "weight", "optimizer", "accumulator"):
        if kind not in (locations or {}):
            log.debug("location_%s set to value useOnChipStorage(False)", kind)


#: PopTorch's names of the output modes in its lowering log (``outputModeToString``)
MODE_NAMES = {"Final": "FINAL", "EveryN": "EVERYN", "All": "ALL", "Sum": "Sum"}


def log_lowering(compiled, placement, log, locations=None, anchors=()):
    """Writes PopTorch's lowering lines for ``compiled`` (placed by the
    strategy spec ``placement``, with the user's tensor ``locations``) to
    ``log`` at debug level; ``anchors``: the anchored tensors
    (``executor.observe.Anchor``: tensor name, output mode, period)."""
    if not log.isEnabledFor(logging.DEBUG):
        return
    program = compiled.program
    graph = program.graphs[program.model_graph]
    mode = _mode(placement)
    forward = [op for op in graph.ops if not op.backward]
    used = {op.ipu for op in forward}
    log.debug("enablePipelining set to value %d", int(mode == "Pipelined" and len(used) > 1))
    if mode == "Phased":
        _phased_settings(program, placement, locations, log)
    # AutoStage.AutoIncrement numbers the blocks as they were entered, PopTorch's
    # default block (the ops before the first block) first: where that block
    # holds no ops, PopTorch's stage numbers start from 1, the program's from 0
    auto = getattr(placement, "auto_increment", False)
    first_stage = int(bool(auto) and not has_default_block(graph))
    log.debug("Graph lowered to PopART {")
    taken = {}
    for op in forward:
        kind = op_type(op)
        scope = op.name.rpartition("/")[0]
        names, types = [], []
        for i, t in enumerate(t for t in op.outputs if t is not None):
            name = f"{scope + '/' if scope else ''}{kind}:{i}"
            k = taken.get(name, 0)
            taken[name] = k + 1
            names.append(f"{name}/{k}" if k else name)
            dtype = str(t.dtype).replace("torch.", "")        # PopART's names: float32
            types.append(f"{dtype}({', '.join(str(s) for s in t.shape)})")
        if mode == "Phased":
            phases = program.phase_of_stage or [0]
            phase = phases[min(op.stage, len(phases) - 1)] * _phase_scale(placement)
            where = f" mode(Phased), ipu({op.ipu}), phase({phase})"
        else:
            where = f" mode({mode}), ipu({op.ipu}), stage({op.stage + first_stage})"
        schema = getattr(op.target, "_schema", None)          # aten::mul, as PopTorch's
        text = schema.name if schema is not None else str(op.target)   # graph prints it
        log.debug("%s = %s was lowered to %s [%s,%s]", op.name, text, ", ".join(names),
                  ", ".join(types), where)
    for a in anchors:
        log.debug("  anchor ( %s %s/%d )", a.long, MODE_NAMES[a.mode.name], a.period)
    log.debug("}")
