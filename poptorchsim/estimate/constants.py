"""Every constant of the cost model, in one place, each with its unit and
where it comes from (docs/cost_model.md lists them).

Two kinds of constant live here:

* module constants the cost model reads at call time (``constants.NAME``),
  so that ``overridden(NAME=value)`` changes the estimate of an op costed
  inside the ``with`` block;
* figures that belong to a target (``Target`` fields: sync cycles, exchange
  bytes per cycle, PCIe, IPU-Link and Streaming Memory bandwidths, host
  latencies); they are listed with ``field`` set and are varied by
  replacing the target's field (``vary_target``).

``kind`` says how much to trust a value: "hardware" (a published figure),
"poplibs" (read from Poplar's own cycle estimators or planners), "estimate"
(a first-principles approximation with its reasoning), "fitted" (chosen so
that an estimate matches one published measurement).

Sources cited by short name: ipu-facts = shared/reference/ipu-facts.md;
poplibs paths refer to github.com/graphcore/poplibs (mk2-main).
"""
import contextlib
import sys
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Constant:
    name: str
    value: float
    unit: str
    kind: str           # hardware, poplibs, estimate, fitted
    source: str
    field: str = ""     # a Target field: varied on the target, not here


REGISTRY: dict = {}
_module = sys.modules[__name__]


def __getattr__(name: str) -> Any:
    """Only for names no ``_constant`` set (those are module attributes): an
    AttributeError.  Declared so that type checkers know the module's
    constants exist (they are set with ``setattr``)."""
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _constant(name, value, unit, kind, source, field=""):
    REGISTRY[name] = Constant(name, value, unit, kind, source, field)
    if name.isupper():
        setattr(_module, name, value)
    return value


# --- compute ------------------------------------------------------------------------------
_constant("VERTEX_OVERHEAD", 40, "cycles per compute set", "poplibs",
          "Starting a compute set's supervisor vertex and its six workers: popops' "
          "basicOpSupervisorOverhead() = 11 cycles (lib/popops/PerformanceEstimation.cpp "
          "l.19) plus the workers' entry and exit, about 5 worker cycles each (popops "
          "element-wise estimators, lib/popops/popopsCycleEstimators.cpp l.152-179)")
_constant("CYCLES_PER_VECTOR", 3, "tile cycles per 64-bit vector", "poplibs",
          "A worker spends about three issue slots (load, operate, store) per 64-bit "
          "vector and the six workers share the tile's issue slots; popops' element-wise "
          "estimators give 2-4 cycles per vector per worker")
_constant("TRANSCENDENTAL_RATE", 0.25, "x element-wise rate", "estimate",
          "exp/log/tanh/sigmoid run as several vector instructions each: a quarter of "
          "the element-wise rate")
_constant("RANDOM_RATE", 0.5, "x element-wise rate", "estimate",
          "the tile's hardware PRNG yields one 64-bit word per cycle, plus scaling")
_constant("CREATION_RATE", 2.0, "x element-wise rate", "estimate",
          "filling a tensor with a constant stores without loading: 2 x the rate")

# --- the AMP units (matmul and convolution) -----------------------------------------------
_constant("AMP_IN_GROUP", 8, "input channels", "hardware",
          "input channels an AMP conv unit chain takes at once (fp32: 8 weights per unit, "
          "ipu-facts 1b; poplibs lib/poplin/ConvVertexType.cpp l.303)")
_constant("AMP_OUT_GROUP", 16, "output channels", "hardware",
          "output channels produced together: one per conv unit, 16 on Mk2 (ipu-facts 1b)")
_constant("MIN_MACS_PER_TILE", 1024, "MACs", "estimate",
          "the planner stops spreading a matmul over more tiles once each tile's work "
          "is below about one vertex's fixed cost (~1k MACs at 16 MACs/cycle = 64 "
          "cycles, comparable with VERTEX_OVERHEAD)")
_constant("OUTPUT_GRAIN", 16, "output elements", "hardware",
          "output elements kept together on one tile: one AMP output group (16 channels)")
_constant("CONV_VERTEX_CYCLES", 217, "cycles per AMP vertex", "poplibs",
          "ConvPartialnx1's supervisor code outside its loops: convNx1Overhead() = 109 "
          "plus 6 workers x 9 (state retention) + 6 x 9 (zeroing partials) "
          "(lib/poplin/PerformanceEstimation.hpp l.44, l.694-713)")
_constant("CONV_POSITION_CYCLES", 400, "cycles per kernel position x channel group",
          "poplibs",
          "ConvPartialnx1 runs its workers once per kernel position and input/output "
          "channel group: supervisor 12 + weight load 32 (16 units x 32 B / 16 B per "
          "cycle) + 15 + 3 = 62 cycles, and each worker's fixed cost 17 + 3 + 45 - 9 = "
          "56 worker cycles (x 6 contexts = 336) before its output elements (fp32; fp16 "
          "45 x 6 = 270): about 400 (PerformanceEstimation.hpp l.759-800, l.955-1000)")

_constant("AMP_COEFF_LOAD_BYTES", 8, "B per cycle", "poplibs",
          "bytes of weights an AMP vertex loads into its conv units per cycle: the "
          "target's convUnitCoeffLoadBytesPerCycle (16) halved because Poplar's default "
          "use128BitConvUnitLoad is false (lib/poplin/ConvModel.cpp l.273-277, "
          "ConvOptions.hpp l.42)")

_constant("MEMCPY_BYTES_PER_CYCLE", 8, "B per cycle", "estimate",
          "bytes a tile copies per cycle when a plan rearranges its operands (the "
          "target's getMemcpyBytesPerCycle, which poplibs' transform cost uses, "
          "lib/poplin/ConvModel.cpp addTransformCycleEstimate); Poplar's Target is not "
          "public: 8 is an unattributed third-party value (ipu-facts.md section 2b), the "
          "64-bit load/store path")

# --- exchange and supersteps --------------------------------------------------------------
_constant("EXCHANGE_EFFICIENCY", 0.5, "x peak exchange rate", "estimate",
          "exchange rarely streams at the 4 B/cycle peak: scattered regions, receive "
          "buffers and exchange code make half of it a fair average")
_constant("EXCHANGE_SETUP_CYCLES", 100, "cycles per exchange", "poplibs",
          "the fixed cost of an exchange program before its first byte: poplibs' CTC "
          "planner uses fixedOverheadExchangeCycles = 100 (lib/popnn/CTCLossPlan.cpp "
          "l.312)")
_constant("CONV_EXTRA_SUPERSTEPS", 2, "supersteps", "poplibs",
          "a forward convolution besides its AMP compute set: input/weight rearrangement "
          "before and the reduction of partials (and cast/bias) after (poplin's "
          "ConvPlan: transform, exchange, reduce stages; lib/poplin/ConvPlan.cpp "
          "l.419-476)")
_constant("CONV_BACKWARD_EXTRA_SUPERSTEPS", 3, "supersteps", "poplibs",
          "a convolution's backward adds the transposition of the weights (flipped "
          "kernel, swapped channels) to the forward's two")
_constant("MATMUL_EXTRA_SUPERSTEPS", 1, "supersteps", "poplibs",
          "a matmul besides its AMP compute set: the reduction or cast of its partials")

# --- reductions and other op classes ------------------------------------------------------
_constant("SOFTMAX_PASSES", 3, "passes over the input", "estimate",
          "max, exp-and-sum, normalise (loss: log-softmax, gather, sum)")
_constant("NORM_PASSES", 4, "passes over the input", "estimate",
          "mean, variance, normalise, scale-and-shift")
_constant("LSTM_CELL_TRANSCENDENTAL", 5, "transcendental ops per unit and step",
          "estimate", "popnn's LSTM cell: three sigmoids and two tanh")
_constant("LSTM_CELL_ELEMENTWISE", 6, "element-wise ops per unit and step", "estimate",
          "c = f*c + i*g, h = o*tanh(c) and the two bias adds")

# --- collectives --------------------------------------------------------------------------
_constant("RING_STEP_SYNC_CYCLES", 1000, "cycles per ring step", "estimate",
          "one step of a ring collective syncs all IPUs of the ring (external sync); "
          "poplibs' IPU Model used globalSyncCycles = 500 (ipu-facts 1d) and a GCL step "
          "also sets up its link transfers: about twice that")
_constant("LINK_HOP_SECONDS", 15e-9, "s per hop", "poplibs",
          "the global-sync latency per hop between IPUs: 15 ns "
          "(lib/poplibs_test/Util.cpp l.432-438 setGlobalSyncLatency, ipu-facts 1d)")

# --- host ---------------------------------------------------------------------------------
_constant("HOST_COPY_LATENCY_S", 2e-5, "s per host stream copy", "fitted",
          "one host stream copy (one input of one micro-batch of one replica) costs "
          "20 us on top of its bytes. Graphcore publishes no figure: fitted to the "
          "on-chip row of the remote-variables tutorial's table (4 replicas x 8 "
          "micro-batches x 2 inputs = 64 copies per step, 2.38 ms per step); the four "
          "off-chip rows follow from the model unfitted", field="host_latency_s")
_constant("CALL_OVERHEAD_S", 7e-4, "s per model call", "fitted",
          "the host side of one model call (launching the engine run, syncing with the "
          "host, the framework's own Python): the PopXL MNIST MLP's inference call "
          "took 0.80 ms host-timed, of which the device's share is a few microseconds",
          field="call_overhead_s")

# --- figures that live on the Target (targets.py) ------------------------------------------
_constant("sync_cycles", 150, "cycles per on-chip sync", "estimate",
          "one internal BSP sync of all tiles (Mk2). Graphcore publishes none; poplibs' "
          "CTC planner uses 90 per exchange plus 100 of exchange overhead, a third-party "
          "IPU21 model getMaxIPUSyncDelay = 126 (ipu-facts 1d)", field="sync_cycles")
_constant("exchange_bytes_per_cycle", 4, "B per tile per cycle", "hardware",
          "IPU Model exchangeBytesPerCycle (poplibs 5f795b13); 1472 x 4 B x 1.33 GHz = "
          "the 8 TB/s Graphcore quotes (ipu-facts 2b)", field="exchange_bytes_per_cycle")
_constant("host_bytes_per_s", 16e9, "B/s", "estimate",
          "PCIe Gen4 x16 is 32 GB/s per direction (ipu-facts 1a: 64 GB/s both ways); "
          "about half of it effective for many small stream copies",
          field="host_bytes_per_s")
_constant("link_bytes_per_s", 32e9, "B/s per IPU-Link, one direction", "hardware",
          "Mk2: 10 IPU-Links, 320 GB/s (ipu-facts 1a)", field="link_bytes_per_s")
_constant("streaming_bytes_per_s", 25e9, "B/s per IPU-Machine", "estimate",
          "Streaming Memory behind the IPU-Machine's gateway: 2 x 100 Gbit/s GW-Links "
          "shared by its 4 IPUs (ipu-facts 1c; Graphcore gives no DRAM bandwidth)",
          field="streaming_bytes_per_s")

_constant("code_bytes_per_tile", 1250, "B per tile", "fitted",
          "the code every tile holds whatever its program: Poplar's runtime, the "
          "supervisor's start-up and the host exchange. Graphcore publishes no figure: "
          "fitted to the development rows of Poplar's own benchmark table (poplibs "
          "8dcde1ec tests/benchmark_results.csv, IpuModel2, the tools that compile IPU "
          "code; held-out rows excluded) with the control code below; the fit is flat "
          "between 1,000 and 2,000 B", field="code_bytes_per_tile")
_constant("control_code_bytes_per_step", 16, "B per compute set per tile", "estimate",
          "the control code a tile holds for each compute set it takes part in: the "
          "sync, the supervisor's call of the compute set's vertex list and the "
          "exchange's send/receive, about four 32-bit instructions. Identical ops "
          "(same kind, shapes and mapping) share theirs, as PopART's outlining makes "
          "repeated layers one Poplar function; a loop's body is held once",
          field="control_code_bytes_per_step")

#: constants a sensitivity analysis varies (the hardware figures are not
#: uncertain enough to vary: tiles, clock, AMP rates, SRAM)
VARIABLE = [name for name, c in REGISTRY.items() if c.kind != "hardware"
            or name in ("AMP_IN_GROUP", "AMP_OUT_GROUP")]


@contextlib.contextmanager
def overridden(**values):
    """Module constants set to ``values`` inside the block (target fields are
    not here: see ``vary_target``)."""
    old = {}
    try:
        for name, value in values.items():
            c = REGISTRY[name]
            if c.field:
                raise KeyError(f"{name} is a Target field: use vary_target")
            old[name] = getattr(_module, name)
            setattr(_module, name, type(c.value)(value) if isinstance(c.value, int)
                    and float(value).is_integer() else value)
        yield
    finally:
        for name, value in old.items():
            setattr(_module, name, value)


def vary_target(target, name, factor):
    """``target`` with the Target-field constant ``name`` scaled by ``factor``."""
    field = REGISTRY[name].field
    return replace(target, **{field: getattr(target, field) * factor})


def table():
    """Rows (name, value, unit, kind, source) for docs and reports."""
    return [(c.name, c.value, c.unit, c.kind, c.source) for c in REGISTRY.values()]
