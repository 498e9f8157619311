"""The pass manager (passes/manager.py) and the pass lists (passes/compile.py):
one signature, contracts checked, the failing pass named."""
import pytest
import torch

from poptorchsim.estimate.targets import with_io_tiles
from poptorchsim.passes import compile as compile_passes
from poptorchsim.passes.compile import INFERENCE, REBUILD_UPDATE, TRAINING, Compilation
from poptorchsim.passes.contracts import LOWERED, PLACED, TRACED
from poptorchsim.passes.manager import Contract, Pass, PassContractError, PassManager
from poptorchsim.runtime.settings.config import CompileConfig


def _inference_compile(passes, check=True):
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())
    config = CompileConfig(training=False)
    c = Compilation(model, config, (torch.randn(2, 8),), {},
                    target=with_io_tiles(config.target, config.io_tiles))
    manager = PassManager(passes, check=check)
    return manager.run(compile_passes.empty_program("inference", config), c), c, manager


@pytest.mark.parametrize("passes, given", [
    (TRAINING, set()), (INFERENCE, set()),
    (REBUILD_UPDATE, {TRACED, LOWERED, PLACED})])     # a compiled program is rebuilt
def test_every_requirement_is_ensured_by_an_earlier_pass(passes, given):
    """The lists as data: what a pass requires, a pass before it ensures."""
    ensured = set(given)
    for p in passes:
        missing = [c.says for c in p.requires if c not in ensured]
        assert not missing, f"{p.name} requires {missing}"
        ensured |= set(p.ensures)


def test_the_lists_run_the_documented_passes_in_order():
    names = [p.name for p in TRAINING]
    assert names == ["trace", "lower", "optimizer update", "place stages", "recompute",
                     "watch gradients", "place update", "map tiles", "precision", "op costs",
                     "locate", "control program", "memory", "estimate", "generate code"]
    assert [p.name for p in INFERENCE] == [n for n in names if n not in (
        "optimizer update", "recompute", "watch gradients", "place update")]
    assert all(p.ensures or p.name in ("precision", "watch gradients") for p in TRAINING)


def test_a_compile_under_the_manager_times_every_pass():
    program, c, manager = _inference_compile(INFERENCE)
    assert list(manager.seconds) == [p.name for p in INFERENCE]
    assert program.main is not None and c.cycles["total"] > 0 and callable(c.step_fn)


def test_a_pass_out_of_order_is_named():
    """Op costs moved before tile mapping: its requirement fails, naming it."""
    order = list(INFERENCE)
    costs = next(p for p in order if p.name == "op costs")
    order.remove(costs)
    order.insert(order.index(next(p for p in order if p.name == "map tiles")), costs)
    with pytest.raises(PassContractError, match="'op costs' requires: every tensor of every "
                                                "graph is mapped onto tiles"):
        _inference_compile(order)


def test_a_pass_that_breaks_the_ir_is_named():
    def careless_placement(program, c):
        program = compile_passes.place_stages(program, c)
        program.graphs[program.model_graph].ops[0].ipu = 7    # an IPU the program lacks
        return program
    broken = [Pass("place stages", careless_placement, (LOWERED,), (PLACED,))
              if p.name == "place stages" else p for p in INFERENCE]
    with pytest.raises(Exception, match="after place stages"):
        _inference_compile(broken)


def test_a_pass_that_breaks_its_promise_is_named():
    never = Contract("never holds", lambda p, c: False)
    with pytest.raises(PassContractError, match="'lower' ensures: never holds; this does not "
                                                "hold after it ran"):
        _inference_compile([INFERENCE[0], Pass("lower", compile_passes.lower_model,
                                               (TRACED,), (LOWERED, never))])


def test_a_pass_must_return_the_program():
    with pytest.raises(PassContractError, match="'forgetful' returned NoneType"):
        _inference_compile([INFERENCE[0], Pass("forgetful", lambda p, c: None)])


def test_unchecked_runs_skip_the_contracts():
    never = Contract("never holds", lambda p, c: False)
    _inference_compile([Pass("trace", compile_passes.trace, requires=(never,))], check=False)
    with pytest.raises(PassContractError, match="'trace' requires: never holds"):
        _inference_compile([Pass("trace", compile_passes.trace, requires=(never,))])
