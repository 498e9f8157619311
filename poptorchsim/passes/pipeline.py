"""Pipeline stages: which stage and IPU every op runs on.

* ``dense_stages``: the stages of a model, in order, from the (stage id,
  IPU) the strategy gives each block.  Ops traced before any block are in
  PopTorch's default block (key ``None``): stage 0 on IPU 0, the stage and
  IPU PopTorch's compiler starts with.  So ``layers[0]`` left unannotated
  before ``BeginBlock(layers[1], ipu_id=1)`` runs on IPU 0 as its own stage.
* ``assign_stages``: forward ops take the stage and IPU of the block they
  were traced in (``BeginBlock``/``Block``, or the default block).  Capture
  switches blocks during the backward pass as the gradients cross block
  boundaries, so the gradient of a layer is computed on the IPU that holds
  the layer.  Optimizer-update ops run on their parameter's IPU.
* ``pipeline_stage_count``: the number of pipeline stages PopTorch's rules
  count: one, plus one each time the active IPU changes in the forward pass,
  starting from IPU 0.
* ``check_rules``: PopTorch's rules, before compiling, with its texts.

The timeline the stages run in (PopTorch's pipeline schedule) is the
estimate's: ``estimate/schedule.py``.
"""
from ..errors import Error


def has_default_block(graph):
    """Whether forward ops were traced before any block (``op.block`` None)."""
    return any(op.block is None and not op.backward for op in graph.ops)


def dense_stages(stage_of_block, entered=()):
    """The model's stages in order, from ``stage_of_block`` = {block id:
    (stage id, IPU)} (block id ``None``: the default block).

    A stage is one (stage id, IPU) pair: blocks sharing both run as one
    stage; one stage id on two IPUs (``Stage("A", "B")`` with blocks on
    different IPUs) is two stages, as PopTorch starts a pipeline stage at
    each change of IPU.  Order: stage id, then the order the model entered
    the blocks (``entered``; the default block first).

    Returns ``(where, keys)``: ``where`` = {block id: (stage index, IPU)},
    ``keys`` = [(stage id, IPU)] per stage index."""
    seen: dict = {}
    for block in (None, *entered, *stage_of_block):
        if block in stage_of_block:
            seen.setdefault(stage_of_block[block], len(seen))
    keys = sorted(seen, key=lambda k: (k[0], seen[k]))
    index = {k: i for i, k in enumerate(keys)}
    where = {b: (index[k], k[1]) for b, k in stage_of_block.items()}
    return where, keys


def pipeline_stage_count(graph):
    """PopTorch's count of forward pipeline stages, which its rules use: one,
    plus one each time the active IPU changes in the forward pass, starting
    from IPU 0 (PopTorch's compiler starts on IPU 0, and counts the switch
    even when no op ran there)."""
    last, switches = 0, 0
    for op in graph.ops:
        if not op.backward and op.ipu != last:
            switches, last = switches + 1, op.ipu
    return switches + 1


def assign_stages(graph, stage_of_block, training):
    """In-place rewrite: sets ``op.stage`` and ``op.ipu`` of every op;
    returns {tensor id: (stage, ipu)}.

    Ops carry the block they were traced in, forward and backward alike
    (capture switches blocks during the backward pass as the gradients cross
    block boundaries).  Ops with no block (before the first ``BeginBlock``)
    run in the default block, key ``None``, where ``stage_of_block`` has one;
    otherwise (and ops whose block is unknown) with the stage of their
    inputs, or the first stage."""
    placed: dict = {}
    first = min(stage_of_block.values()) if stage_of_block else (0, 0)
    for op in graph.ops:
        ins = [placed[t.id] for t in op.input_tensors() if t.id in placed]
        key = None if op.block is None else op.block[0]
        if key in stage_of_block and (key is not None or op.block is None):
            where = stage_of_block[key]
        else:
            where = min(ins) if ins else first
        op.stage, op.ipu = where
        op.backward = op.backward and training
        for t in op.outputs:
            if t is not None:
                placed[t.id] = where
    return placed


def check_shared_weights(graph, tied):
    """A parameter or buffer must be used on one IPU (PopTorch's user guide:
    "You need to place layers that share weights on the same IPU").  Raises
    an error naming the modules that use it on each IPU and the fix.

    ``tied``: ``{name: [every module path of the tensor]}``, from capture."""
    users: dict = {}                       # tensor id -> {ipu: [module, ...]}
    held = {t.id: t for t in graph.inputs if t.role in ("param", "buffer")}
    for op in graph.ops:
        if op.backward:
            continue
        for t in op.input_tensors():
            if t.id in held:
                module = op.name.rpartition("/")[0] or op.name
                users.setdefault(t.id, {}).setdefault(op.ipu, [])
                if module not in users[t.id][op.ipu]:
                    users[t.id][op.ipu].append(module)
    for tid, by_ipu in users.items():
        if len(by_ipu) < 2:
            continue
        t = held[tid]
        names = tied.get(t.name, [t.name])
        also = f" (also named {', '.join(n for n in names if n != t.name)})" \
            if len(names) > 1 else ""
        where = " and ".join(f"IPU {ipu} (by {', '.join(mods)})"
                             for ipu, mods in sorted(by_ipu.items()))
        kind = "Parameter" if t.role == "param" else "Buffer"
        raise Error(
            f"{kind} {t.name}{also} is used on {where}. Layers that share weights must be "
            "placed on the same IPU: put the modules that use it in blocks with the same "
            "ipu_id (poptorch.BeginBlock / poptorch.Block), or untie the weights.")


def place_update(graph, ipu_of_param, stage_of_param=None):
    """In-place rewrite: optimizer-update ops run on the IPU that holds their
    parameter, in the stage (and so the phase) of the parameter's first use
    (sets ``op.ipu`` and ``op.stage``)."""
    stage_of_param = stage_of_param or {}
    placed = {}
    for t in graph.inputs:
        name = t.name.split("/", 1)[-1]
        if name in ipu_of_param:
            placed[t.id] = (ipu_of_param[name], stage_of_param.get(name, 0))
    for op in graph.ops:
        found = [placed[t.id] for t in op.input_tensors() if t.id in placed]
        op.ipu, op.stage = max(found) if found else (0, 0)
        for t in op.outputs:
            if t is not None:
                placed[t.id] = (op.ipu, op.stage)


def input_stages(graph):
    """The stage of each graph input: that of its first consumer."""
    return _of_first_consumer(graph, "stage")


def input_ipus(graph):
    """The IPU of each graph input: that of its first consumer."""
    return _of_first_consumer(graph, "ipu")


def _of_first_consumer(graph, attr):
    found: dict = {}
    for op in graph.ops:
        for t in op.input_tensors():
            found.setdefault(t.id, getattr(op, attr))
    return {t.name: found.get(t.id, 0) for t in graph.inputs}


def stage_map_text(graph, stage_of_block):
    """Which blocks and how many ops sit on each stage and IPU.
    ``stage_of_block``: {block id: (stage index, IPU)}, ``where`` of
    ``dense_stages`` (block id ``None``: the ops before the first block)."""
    lines = []
    by_stage: dict = {}
    for block, (stage, ipu) in stage_of_block.items():
        by_stage.setdefault((stage, ipu), []).append(block)
    for (stage, ipu), blocks in sorted(by_stage.items()):
        n = sum(1 for op in graph.ops if op.stage == stage and not op.backward)
        named = ", ".join(str(b) for b in blocks if b is not None)
        what = " and ".join(([f"blocks {named}"] if named else [])
                            + (["the ops before the first block"] if None in blocks else []))
        lines.append(f"  stage {stage} on IPU {ipu}: {what} ({n} forward ops)")
    return "\n".join(lines)


def num_ipus_needed(stage_of_block):
    """PopTorch's count: the IPUs used, or the highest IPU index + 1."""
    ipus = {ipu for _, ipu in stage_of_block.values()} or {0}
    return max(len(ipus), max(ipus) + 1)


def reserve_ipus(total, auto_round, hardware, logger=None):
    """PopTorch's reservation of ``total`` IPUs on hardware of ``hardware``
    IPUs: a power of 2 (rounded up with autoRoundNumIPUs, else refused), and
    no more than the system has."""
    rounded = 1 << (total - 1).bit_length()
    common = ", because PopTorch must reserve a power of 2 or maximum of 64 IPUs per process"
    if rounded != total:
        if not auto_round:
            raise Error(f"The model specifies the use of {total} IPUs, however PopTorch must "
                        f"reserve a minimum of {rounded} in order to allow the model to run"
                        f"{common}. Please reconfigure your model to use a different number "
                        "of IPUs or set poptorch.Options().autoRoundNumIPUs(True).")
        if logger is not None:          # PopTorch's words, its spelling too
            logger.warning(f"Reserving {rounded} IPUs when the model specifices the use of "
                           f"only {total}{common}. {rounded - total} will be reserved but "
                           "not used.")
    if rounded > hardware:
        raise Error(f"Failed to acquire {rounded} IPU(s): the simulated system reports "
                    f"{hardware} IPUs as hardware (POPTORCHSIM_IPU_HARDWARE). Use fewer IPUs "
                    "or replicas, or a larger system (POPTORCHSIM_IPU_HARDWARE=64).")


def check_rules(*, training, pipelined, n_stages, di, ga, rf, n_ipus, auto_round,
                stage_map, logger=None, stages_with_ops=None, hardware=None):
    """PopTorch's pipelining and IPU-count rules, raised before compiling.

    ``n_stages``: the forward stages PopTorch counts (``pipeline_stage_count``);
    ``stages_with_ops``: the stages of the stage map, where that differs;
    ``hardware``: the IPUs the system reports as hardware (None: the IPU
    Model, an offline target, or no hardware)."""
    total = n_ipus * rf
    if total > 64:
        raise Error(f"Too many IPUs requested ({total}). Experiments that need more than "
                    "64 IPUs require distributed execution.")
    if hardware is not None:
        reserve_ipus(total, auto_round, hardware, logger)
    elif total & (total - 1) and logger is not None:
        # PopTorch reserves IPU hardware in powers of 2 and refuses other
        # counts without autoRoundNumIPUs; the IPU Model and offline targets,
        # which a simulator stands for, take any count (PopTorch's own
        # tests compile 3-IPU models there).  Said, not enforced.
        rounded = 1 << (total - 1).bit_length()
        if auto_round:
            logger.warning(f"Reserving {rounded} IPUs when the model specifies the use of "
                           f"only {total}: on IPU hardware PopTorch reserves a power of 2; "
                           f"{rounded - total} will be reserved but not used.")
        else:
            logger.warning(
                f"The model specifies the use of {total} IPUs: on IPU hardware PopTorch "
                f"must reserve a minimum of {rounded}, because it reserves a power of 2 or "
                "maximum of 64 IPUs per process, and raises an error unless "
                "poptorch.Options().autoRoundNumIPUs(True) is set. The IPU Model and "
                "offline targets (and this simulator) run it as it is.")
    if not pipelined or n_stages <= 1:
        return
    if stages_with_ops is not None and stages_with_ops != n_stages:
        stage_map += (f"\n  ({stages_with_ops} stages hold ops; PopTorch counts {n_stages}: "
                      "one, plus one each time the active IPU changes, starting from "
                      "IPU 0)")
    if training:
        needed = 2 * n_stages - 1
        if ga < needed:
            raise Error(
                "poptorch.Options().Training.gradientAccumulation must be greater than or "
                f"equal to the number of pipeline stages ({needed}) when using "
                f"poptorch.PipelinedExecution. Please note that a model with {n_stages} "
                f"pipeline stages in PopTorch will have an additional {n_stages - 1} stages "
                f"when training.\nStage map:\n{stage_map}\nSet "
                f"Training.gradientAccumulation({needed}) or more (it is {ga}).")
    elif di < n_stages:
        raise Error(
            "poptorch.Options().deviceIterations must be greater than or equal to the "
            f"number of pipeline stages ({n_stages}) when using PopTorch.PipelinedExecution."
            f"\nStage map:\n{stage_map}\nSet deviceIterations({n_stages}) or more (it is {di}).")
