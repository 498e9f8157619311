"""The pass manager: a pass list as data, run pass by pass under contracts.

A compile is a list of ``Pass`` records (``passes/compile.py`` holds the
lists).  Every pass has one signature, ``run(program, compilation) ->
program``: it takes the IR and the compile's inputs and side products (a
``passes.compile.Compilation``), and returns the IR.  Beside its function a
pass declares what it needs from the passes before it (``requires``) and
what it leaves behind (``ensures``), each a ``Contract``: a sentence and a
predicate over the program and the compilation.

``PassManager.run`` runs the list in order, times every pass
(``PassManager.seconds``, reported as ``Compiled.pass_seconds``) and, when
checking (``VERIFY_EACH_PASS``, on in the test suite), checks each pass's
``requires`` before it and its ``ensures`` and the IR verifier
(``ir/verify.py``) after it.  A broken contract raises ``PassContractError``
naming the pass, which side of it failed and the sentence of the contract.
"""
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from tqdm.auto import tqdm

from ..errors import Error
from ..ir.graph import Program
from ..ir.verify import verify_program

#: check every pass's contracts and run the IR verifier after it (tests/conftest.py
#: turns it on)
VERIFY_EACH_PASS = os.environ.get("POPTORCHSIM_VERIFY_PASSES", "") not in ("", "0")


class PassContractError(Error):
    """A pass ran on a program its ``requires`` refuse, or left one its
    ``ensures`` refuse: a bug in the compiler (or in a pass list put
    together in the wrong order), never in the user's model."""


@dataclass(frozen=True)
class Contract:
    """What holds of a program at one point of the pass list: ``says`` in
    words (the error prints it), ``holds(program, compilation)`` checks it."""
    says: str
    holds: Callable[[Program, Any], bool]


@dataclass(frozen=True)
class Pass:
    """One pass: its name (the timing table's and the errors'), its
    function, its contracts and, for the progress bar, the words shown
    while it runs (``shows``; None: the bar does not move)."""
    name: str
    run: Callable[[Program, Any], Program]
    requires: tuple = ()             # Contracts that hold before it runs
    ensures: tuple = ()              # Contracts that hold after it ran
    shows: Optional[str] = None


@dataclass
class PassManager:
    """Runs a pass list (see the module's docstring).  ``check``: the
    contracts and the verifier (default ``VERIFY_EACH_PASS``); ``show``: a
    progress bar over the passes that show a description."""
    passes: Sequence[Pass]
    check: bool = VERIFY_EACH_PASS
    show: bool = False
    seconds: dict = field(default_factory=dict)     # pass name -> seconds

    def run(self, program: Program, compilation: Any) -> Program:
        stages = sum(p.shows is not None for p in self.passes)
        bar = tqdm(total=stages + 1, desc="Graph compilation", disable=not self.show,
                   leave=False,
                   bar_format="{desc}: {percentage:3.0f}%|{bar}| {n}/{total} [{elapsed}]")
        try:
            for p in self.passes:
                if p.shows is not None:
                    bar.set_description(p.shows)
                    bar.update(1)
                if self.check:
                    self._check(p, "requires", p.requires, program, compilation)
                start = time.perf_counter()
                result = p.run(program, compilation)
                self.seconds[p.name] = (self.seconds.get(p.name, 0.0)
                                        + time.perf_counter() - start)
                if not isinstance(result, Program):
                    raise PassContractError(
                        f"Pass {p.name!r} returned {type(result).__name__}, not the Program: "
                        "every pass returns the IR it was given or the IR it made")
                program = result
                if self.check:
                    verify_program(program, after=p.name)
                    self._check(p, "ensures", p.ensures, program, compilation)
            bar.update(1)
        finally:
            bar.close()
        return program

    @staticmethod
    def _check(p, side, contracts, program, compilation):
        for contract in contracts:
            if not contract.holds(program, compilation):
                before = "before it ran" if side == "requires" else "after it ran"
                raise PassContractError(
                    f"Pass {p.name!r} {side}: {contract.says}; this does not hold {before}. "
                    "The pass list is out of order or the pass is wrong "
                    "(poptorchsim/passes/compile.py).")
