"""IPU targets: the figures the cost and memory models read.

One row per target, from ../shared/reference/ipu-facts.md §1-2: tiles, SRAM
per tile, clock, AMP multiply-accumulates per tile per cycle, the 64-bit
vector path, six workers, 4 bytes per cycle of exchange per tile, IPU-Link
and PCIe figures.  ``IPU-Test`` is a 4-tile Mk2 for fast tests, like
PopTorch's small IPU Model.

Selected as PopTorch selects its IPU Model: ``Options.useIpuModelVersion``
(or ``useOfflineIpuTarget``), else the environment variables
``POPTORCHSIM_IPU_MODEL_VERSION`` (ipu1, ipu2, ipu21, or mk1, mk2, bow, test)
and ``POPTORCHSIM_SMALL_IPU_MODEL=1``; Mk2 by default.
"""
import os
from dataclasses import asdict, dataclass, replace

from ..errors import Error
from . import constants as _K

# Each modelling figure below (sync cycles, PCIe, IPU-Link and Streaming
# Memory bandwidths, the host latencies) is registered with its source in
# constants.py (docs/cost_model.md lists them).
HOST_COPY_LATENCY_S = _K.HOST_COPY_LATENCY_S
CALL_OVERHEAD_S = _K.CALL_OVERHEAD_S


@dataclass(frozen=True)
class Target:
    name: str
    tiles: int
    bytes_per_tile: int
    clock_hz: float
    amp_macs_fp32: int          # multiply-accumulates per tile per cycle, fp32
    amp_macs_fp16: int          # fp16 operands, fp16 partials (16.16)
    vector_bytes: int           # bytes a tile's vector unit handles per cycle
    workers: int
    exchange_bytes_per_cycle: int   # bytes a tile receives per cycle
    sync_cycles: int            # one on-chip BSP sync
    link_bytes_per_s: float     # one IPU-Link, one direction
    links: int
    host_bytes_per_s: float     # PCIe, one direction, effective
    host_latency_s: float       # per host stream transfer
    call_overhead_s: float = 0.0    # host-side launch and sync of one model call
    # Streaming Memory: DDR behind the IPU-Machine's gateway, 2 x 100 Gbit/s
    # GW-Links shared by its 4 IPUs (ipu-facts §1).  Graphcore gives no DRAM
    # bandwidth; this makes Streaming Memory about 5x slower than one IPU-Link
    # when all 4 IPUs stream, inside the "3x to 20x slower than IPU-Links"
    # that Graphcore's remote-variables tutorial quotes.
    streaming_bytes_per_s: float = _K.REGISTRY["streaming_bytes_per_s"].value
    ipus_per_machine: int = 4
    grain_bytes: int = 64       # smallest piece of a tensor mapped to one tile
    # always-live code: the runtime on every tile, and control code per
    # compute set a tile takes part in (passes/memory.py)
    code_bytes_per_tile: int = int(_K.REGISTRY["code_bytes_per_tile"].value)
    control_code_bytes_per_step: int = int(_K.REGISTRY["control_code_bytes_per_step"].value)
    # Tiles set aside for host IO (Options.TensorLocations.numIOTiles): they
    # are not counted in ``tiles``, which are the compute tiles.
    io_tiles: int = 0
    # fp16 operands accumulating float partials (16.32), MACs per tile per
    # cycle; 0: as fast as fp16 partials.  ipu-facts §1b gives the fp16 AMP
    # rate (Mk2 64 = 16 conv units x 4 halves; Mk1 32 = 8 x 4, both partials
    # types: poplibs cba27e0c has fp16InFp16Out = fp16InFp32Out = 8 units).
    # On Mk2 the fp16-in fp32-out units are limited by the 64-bit store path:
    # poplibs tools/single_conv_layer.cpp sets fp16InFp32OutConvUnitsPerTile =
    # min(fp16InFp16Out units, pipeline depth 4 x fp32 stored per cycle 2) = 8,
    # so float partials get half the MACs: 8 x 4 = 32.
    amp_macs_fp16_float_partials: int = 0
    # Tile memory layout (PopVision's "including gaps"): the operands of the
    # AMP vertices live in the interleaved region, which starts this many
    # bytes above the tile's base; below it the non-interleaved region holds
    # code, vertex state and the rest, and whatever it leaves unused is a
    # gap.  Mk2: 208 KiB, read off Poplar's own IpuModel2 figures for the
    # development rows (benchmarks/poplar_layers.py): a fully-connected layer
    # with a few hundred bytes per tile reports 213,064 B on its fullest tile
    # (fc_layer_8_1000_5_half: 212,992 + 72), every matmul layer at least
    # 212,992 B, while layers without matmuls report their bytes alone.
    # Fitted on those development rows.
    interleaved_start: int = 212_992

    @property
    def total_bytes(self):
        return self.tiles * self.bytes_per_tile

    def as_dict(self):
        return asdict(self)


MK2 = Target("Mk2", tiles=1472, bytes_per_tile=638_976, clock_hz=1.33e9,
             amp_macs_fp32=16, amp_macs_fp16=64, amp_macs_fp16_float_partials=32,
             vector_bytes=8, workers=6,
             exchange_bytes_per_cycle=_K.REGISTRY["exchange_bytes_per_cycle"].value,
             sync_cycles=_K.REGISTRY["sync_cycles"].value,
             link_bytes_per_s=_K.REGISTRY["link_bytes_per_s"].value, links=10,
             host_bytes_per_s=_K.REGISTRY["host_bytes_per_s"].value,
             host_latency_s=HOST_COPY_LATENCY_S, call_overhead_s=CALL_OVERHEAD_S)

MK1 = replace(MK2, name="Mk1", tiles=1216, bytes_per_tile=262_144, clock_hz=1.6e9,
              amp_macs_fp32=8, amp_macs_fp16=32, amp_macs_fp16_float_partials=32,
              link_bytes_per_s=128 / 8 * 1024 ** 3 * 0.85)

BOW = replace(MK2, name="Bow", clock_hz=1.85e9, link_bytes_per_s=64e9)

# a 4-tile toy for tests: a flat 8 KiB of code per tile
TEST_IPU = replace(MK2, name="IPU-Test", tiles=4, code_bytes_per_tile=8 * 1024,
                   control_code_bytes_per_step=0)

TARGETS = {"mk1": MK1, "ipu1": MK1, "mk2": MK2, "ipu2": MK2, "bow": BOW, "ipu21": BOW,
           "test": TEST_IPU, "small": TEST_IPU}


def with_io_tiles(target, n):
    """``target`` with ``n`` of its tiles set aside as IO tiles: the compute
    graph is mapped on the rest (PopTorch's ``numIOTiles``)."""
    if not n:
        return target
    if n >= target.tiles:
        raise Error(f"numIOTiles({n}) leaves no compute tiles on {target.name} "
                    f"({target.tiles} tiles): use fewer IO tiles or a larger IPU model "
                    "(Options.useIpuModelVersion).")
    return replace(target, tiles=target.tiles - n, io_tiles=n)


def target_named(name):
    key = str(name).lower()
    if key not in TARGETS:
        raise Error(f"Unknown IPU model version {name!r}; choose one of "
                    f"ipu1/mk1, ipu2/mk2, ipu21/bow or test")
    return TARGETS[key]


def default_target(version=None):
    """``version`` (from Options) or the environment's choice, Mk2 by default."""
    if version is not None:
        return target_named(version)
    if os.environ.get("POPTORCHSIM_SMALL_IPU_MODEL", "") not in ("", "0"):
        return TEST_IPU
    return target_named(os.environ.get("POPTORCHSIM_IPU_MODEL_VERSION", "ipu2"))


HARDWARE_ENV = "POPTORCHSIM_IPU_HARDWARE"
_ON, _OFF = ("1", "on", "true", "yes"), ("", "0", "off", "false", "no")
MAX_IPUS_PER_PROCESS = 64     # PopTorch reserves at most 64 IPUs per process


def hardware_ipus():
    """The IPUs the simulated system reports as hardware, or None (the
    default: no hardware, as honest), from ``POPTORCHSIM_IPU_HARDWARE``
    (``parse_hardware``; ``docs/porting.md``)."""
    return parse_hardware(os.environ.get(HARDWARE_ENV, ""), f"{HARDWARE_ENV}=")


def parse_hardware(value, source):
    """IPUs from a setting: 1, on, true or yes for an IPU-POD64's 64 IPUs; a
    number from 2 for that many; 0, off, false, no or nothing for none
    (None).  ``source`` names where it came from in the error."""
    value = str(value).strip().lower()
    if value in _OFF:
        return None
    if value in _ON:
        return MAX_IPUS_PER_PROCESS
    if value.isdigit() and int(value) >= 2:
        return int(value)
    from ..errors import Error
    raise Error(f"{source}{value!r} is not a setting: use 1 (or on) for a system of "
                f"{MAX_IPUS_PER_PROCESS} IPUs, a number from 2 for that many IPUs, or 0 "
                "(or unset) for no hardware")
