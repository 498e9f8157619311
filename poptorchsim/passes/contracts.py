"""The contracts of the compile's passes (``passes/manager.py``): what holds
of the program, and of the compile's side products, after each pass.
``passes/compile.py`` names them as each pass's ``requires`` and
``ensures``."""
from .manager import Contract


def _all_ops(program):
    return [op for g in program.graphs.values() for op in g.ops]


TRACED = Contract("the model is traced (compilation.capture)",
                  lambda p, c: c.capture is not None)
LOWERED = Contract("the model's graph is lowered: every op has its ATen target and cost class",
                   lambda p, c: p.model_graph in p.graphs and all(
                       op.target is not None and op.cost_class is not None
                       for op in p.graphs[p.model_graph].ops))
UPDATE_BUILT = Contract("the optimizer update is lowered (graph 'optimizer_update')",
                        lambda p, c: "optimizer_update" in p.graphs
                        and c.update is not None and c.numeric is not None)
PLACED = Contract("every op of the model's graph has a stage and an IPU of the program's",
                  lambda p, c: all(0 <= op.stage < max(p.n_stages, 1) and op.ipu < p.n_ipus
                                   for op in p.graphs[p.model_graph].ops))
RECOMPUTE_PLANNED = Contract("the training step has its recomputation plan",
                             lambda p, c: p.graphs["training_step"].recompute is not None)
UPDATE_PLACED = Contract("every op of the optimizer update runs on an IPU of the program's",
                         lambda p, c: all(op.ipu < p.n_ipus
                                          for op in p.graphs["optimizer_update"].ops))
MAPPED = Contract("every tensor of every graph is mapped onto tiles",
                  lambda p, c: all(t.mapping is not None for g in p.graphs.values()
                                   for t in g.tensors))
COSTED = Contract("every op of every graph has its cost",
                  lambda p, c: all(len(c.costs.get(name, ())) == len(g.ops)
                                   for name, g in p.graphs.items()))
LOCATED = Contract("every variable off chip or sharded is one of the program's device variables",
                   lambda p, c: set(p.locations) <= set(p.variables))
MAIN_BUILT = Contract("the control program is built (Program.main)",
                      lambda p, c: p.main is not None)
MEMORY_PLANNED = Contract("every IPU has its memory report",
                          lambda p, c: c.memory is not None
                          and len(c.memory.ipus) == p.n_ipus)
ESTIMATED = Contract("the call's cycles are estimated (a breakdown whose total is positive)",
                     lambda p, c: bool(c.cycles) and c.cycles["total"] > 0)
CODE_MADE = Contract("the model's graph has its generated function",
                     lambda p, c: callable(c.step_fn))
