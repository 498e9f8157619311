"""Observing a compiled model: tensor names, anchors, compile hooks, the
cycle counter and updatable buffers (PopTorch's debugging API).

* Tensor names are the IR's (``print(model.getIR())``): every input and op
  result of the step graph, plus PopTorch's names ``Gradient___<param>``
  (a parameter's gradient of one micro-batch) and ``UpdatedVar___<param>``
  (the parameter after an optimizer step) in training.
* An anchor (``Options.anchorTensor``) makes the step graph also return the
  tensor: the engine's step function is compiled once more with the
  anchored tensors as extra outputs, which a tap strips off and collects
  per micro-batch, by the anchor's output mode, as model outputs are.
"""
import collections
import contextlib
import copy
import logging

import torch
from torch.utils.hooks import RemovableHandle

from ... import enums
from ...errors import Error
from ...machine.call_state import OutputCollector
from ...machine.codegen import compile_graph

logger = logging.getLogger("poptorchsim")

GRADIENT = "Gradient___"
UPDATED = "UpdatedVar___"
NO_UPDATABLE_BUFFERS = ("No named buffers marked as updatable via updatableNamedBuffers "
                        "option")
CYCLES_DISABLED = ("Cycle count logging is disabled. Please set option logCycleCount to "
                   "True to enable.")
CYCLES_NOT_RUN = "Please run the model at least once before obtaining cycle count."

# -- compile hooks ---------------------------------------------------------------------
PRE_COMPILE_HOOKS = collections.OrderedDict()
POST_COMPILE_HOOKS = collections.OrderedDict()


def register_hook(hooks, hook, when):
    """Adds ``hook`` to ``hooks``; the handle's ``remove()`` takes it out."""
    if not callable(hook):
        raise RuntimeError(f"{when}-compile hook must be callable")
    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


@contextlib.contextmanager
def compile_hooks():
    """Runs the pre-compile hooks, then the body (tracing and compiling),
    then the post-compile hooks, even when compiling fails (as PopTorch)."""
    for hook in list(PRE_COMPILE_HOOKS.values()):
        hook()
    try:
        yield
    finally:
        for hook in list(POST_COMPILE_HOOKS.values()):
            hook()


# -- tensor names ----------------------------------------------------------------------
def step_graph(compiled):
    graphs = compiled.program.graphs
    return graphs.get("training_step") or graphs["inference_forward"]


def tensor_names(compiled):
    """Every tensor name that ``anchorTensor`` accepts, in graph order."""
    step = step_graph(compiled)
    names = [t.name for t in step.inputs]
    names += [t.name for op in step.ops for t in op.outputs if t is not None]
    for n in compiled.capture.trainable_names:
        names += [GRADIENT + n, UPDATED + n]
    return list(dict.fromkeys(names))


def _gradient_tensor(compiled, name):
    """The step graph's output holding the gradient of parameter ``name``."""
    step = step_graph(compiled)
    trainable = compiled.capture.trainable_names
    first = (len(step.outputs) - step.statistics_outputs
             - len(compiled.capture.buffer_names) - len(trainable))
    return step.outputs[first + trainable.index(name)]


# -- anchors ---------------------------------------------------------------------------
class Anchor:
    """One ``anchorTensor``: where its value comes from and how many to keep."""

    def __init__(self, short, long, mode, period):
        self.short, self.long, self.mode, self.period = short, long, mode, period
        self.updated = None          # index of the parameter, for UpdatedVar___
        self.collector = None


def anchors_from_options(options, model_mode):
    """The anchors of ``options``, each with its output mode resolved (the
    model's mode, and its period, where the anchor names none)."""
    found = []
    for short, (long, default, mode, period) in options.anchored_tensors.items():
        if default:
            mode, period = model_mode, options.output_return_period
        mode = enums.OutputMode(mode)
        if mode == enums.OutputMode.Default:
            mode = model_mode
        found.append(Anchor(short, long, mode, period if mode == enums.OutputMode.EveryN
                            else 1))
    return found


class AnchorTap:
    """Collects anchored tensors while the engine runs a compiled program."""

    def __init__(self, anchors, compiled):
        self.anchors = anchors
        names = set(tensor_names(compiled))
        step = step_graph(compiled)
        by_name = {t.name: t for t in step.inputs}
        by_name.update({t.name: t for op in step.ops for t in op.outputs if t is not None})
        trainable = compiled.capture.trainable_names
        self.step_anchors, self.update_anchors, extra = [], [], []
        for a in anchors:
            if a.long not in names and ("___specific___" in a.long
                                        or a.long == "lossScaling_FLOAT"):
                raise Error(f"anchorTensor({a.short!r}, {a.long!r}): the optimizer's tensors "
                            "cannot be anchored here; read their values with "
                            "optimizer.state_dict()['ipu_param'].")
            if a.long not in names:
                raise Error(f"anchorTensor({a.short!r}, {a.long!r}): the model has no tensor "
                            f"named {a.long!r}. Pick one of getTensorNames() (the IR's "
                            "names, print(model.getIR()), and Gradient___<param> or "
                            "UpdatedVar___<param> in training).")
            if a.long.startswith(UPDATED) and a.long[len(UPDATED):] in trainable:
                a.updated = trainable.index(a.long[len(UPDATED):])
                self.update_anchors.append(a)
                continue
            if a.long.startswith(GRADIENT) and a.long[len(GRADIENT):] in trainable:
                extra.append(_gradient_tensor(compiled, a.long[len(GRADIENT):]))
            else:
                extra.append(by_name[a.long])
            self.step_anchors.append(a)
        self.n_extra = len(extra)
        self.step_fn = None
        if extra:
            graph = copy.copy(step)
            graph.outputs = list(step.outputs) + extra
            self.step_fn = self._tap(compile_graph(graph))

    def install(self, engine, update_fn):
        """The engine runs the tapped step (and update) functions from now on."""
        if self.step_fn is not None:
            engine.step_fn = self.step_fn
        if self.update_anchors:
            if engine.shards:
                raise Error(f"anchorTensor({self.update_anchors[0].long!r}): UpdatedVar___ "
                            "anchors cannot be read while the optimizer state is sharded "
                            "across replicas (replicated tensor sharding); anchor the "
                            "Gradient___ tensor, or read the weights with "
                            "copyWeightsToHost().")
            engine.update_fn = self.tap_update(update_fn)

    def _tap(self, fn):
        n = self.n_extra

        def step(inputs):
            outs = fn(inputs)
            self._add_step(outs[len(outs) - n:])
            return outs[:len(outs) - n]
        return step

    def tap_update(self, fn):
        def update(inputs):
            new = fn(inputs)
            for a in self.update_anchors:
                a.collector.add(self._updates, 0, 0, [new[a.updated].clone()])
            self._updates += 1
            return new
        return update

    def start(self, di, ga, rf):
        """Before a call: empty collectors for ``di`` x ``ga`` x ``rf`` micro-batches."""
        self._shape, self._calls, self._updates = (ga, rf), 0, 0
        for a in self.step_anchors:
            a.collector = OutputCollector(a.mode.name, a.period, di, ga, rf)
        for a in self.update_anchors:
            a.collector = OutputCollector(a.mode.name, a.period, di, 1, 1)

    def _add_step(self, values):
        ga, rf = self._shape
        k = self._calls
        i, g, r = k // (ga * rf), (k // rf) % ga, k % rf
        for a, v in zip(self.step_anchors, values):
            a.collector.add(i, g, r, [v.clone()])
        self._calls += 1

    def results(self):
        """{short name: value} of the last call, shaped as model outputs are."""
        out = {}
        for a in self.step_anchors + self.update_anchors:
            parts = [row[0] for row in a.collector.result()]
            if not parts:
                continue
            if len(parts) == 1:
                out[a.short] = parts[0]
            elif parts[0].dim() == 0:
                out[a.short] = torch.stack(parts)
            else:
                out[a.short] = torch.cat(parts)
        return out


# -- updatable buffers -----------------------------------------------------------------
def updatable_buffers(options):
    """The names given to ``Options.updatableNamedBuffers``, or None."""
    return options._Popart.options.get("updatableNamedBuffers")


def check_updatable_buffers(options, model):
    """At compile: every updatable buffer must be one of the model's."""
    names = updatable_buffers(options)
    if names is None:
        return
    known = [n for n, _ in model.named_buffers()]
    missing = [n for n in names if n not in known]
    if missing:
        raise Error(f"updatableNamedBuffers: the model has no buffer named "
                    f"{', '.join(map(repr, missing))}; its buffers are {known}.")


# -- cycle counter -----------------------------------------------------------------------
def cycle_count(options, compiled, has_run):
    """Cycles the simulated IPU ran in the last call: the estimate's total
    less the host-side launch overhead (the hardware counter starts when the
    device program does)."""
    if not options._Popart.options.get("instrumentWithHardwareCycleCounter"):
        raise Error(CYCLES_DISABLED)
    if compiled is None or not has_run:
        raise Error(CYCLES_NOT_RUN)
    target = compiled.target
    return int(round(compiled.cycles["total"] - target.call_overhead_s * target.clock_hz))


# -- one executor's observation state ------------------------------------------------------
class Observation:
    """What an executor observes of its compiled program: its anchors'
    values after each call, and whether it has run (for ``cycleCount``)."""

    def __init__(self, options, model_mode):
        self.options = options
        self.anchors = anchors_from_options(options, model_mode)
        self.tap = None
        self.values = {}
        self.has_run = False

    def check(self, model):
        """Before compiling: the options name only what the model has."""
        check_updatable_buffers(self.options, model)

    def attach(self, compiled, engine):
        """After compiling: the engine collects the anchored tensors."""
        self.tap = None
        if self.anchors:
            self.tap = AnchorTap(self.anchors, compiled)
            self.tap.install(engine, compiled.update_fn)

    def start(self, di, ga, rf):
        if self.tap is not None:
            self.tap.start(di, ga, rf)

    def finish(self, compiled):
        """After a call: keep the anchors' values, log the cycle count."""
        if self.tap is not None:
            self.values = self.tap.results()
        self.has_run = True
        if self.options._Popart.options.get("instrumentWithHardwareCycleCounter"):
            logger.debug("Cycle count: %d", cycle_count(self.options, compiled, True))

    def anchored(self, short_name):
        assert short_name in self.values, f"No tensor with name {short_name} found."
        value = self.values[short_name]
        return value.cpu() if isinstance(value, torch.Tensor) else value     # to the host
