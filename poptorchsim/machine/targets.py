"""IPU targets: the figures the cost and memory models read.

Sources: ../shared/reference/ipu-facts.md §1 (tiles, SRAM, clock, AMP rates,
exchange, PCIe).  ``IPU-Test`` is a 4-tile IPU for fast tests.
"""
import os
from dataclasses import dataclass

from ..errors import Error


@dataclass(frozen=True)
class Target:
    name: str
    tiles: int
    bytes_per_tile: int
    clock_hz: float
    amp_macs_fp32: int          # multiply-accumulates per tile per cycle, fp32
    amp_macs_fp16: int
    vector_bytes: int           # bytes a tile's vector unit handles per cycle
    workers: int
    exchange_bytes_per_cycle: int   # bytes a tile receives per cycle
    sync_cycles: int            # one on-chip BSP sync
    host_bytes_per_s: float     # PCIe, one direction, effective
    host_latency_s: float       # per host stream transfer
    grain_bytes: int = 64       # smallest piece of a tensor mapped to one tile
    code_bytes_per_tile: int = 24 * 1024   # control code and runtime, always live

    @property
    def total_bytes(self):
        return self.tiles * self.bytes_per_tile


MK2 = Target("Mk2", tiles=1472, bytes_per_tile=638_976, clock_hz=1.33e9,
             amp_macs_fp32=16, amp_macs_fp16=64, vector_bytes=8, workers=6,
             exchange_bytes_per_cycle=4, sync_cycles=150,
             host_bytes_per_s=16e9, host_latency_s=5e-6)

TEST_IPU = Target("IPU-Test", tiles=4, bytes_per_tile=638_976, clock_hz=1.33e9,
                  amp_macs_fp32=16, amp_macs_fp16=64, vector_bytes=8, workers=6,
                  exchange_bytes_per_cycle=4, sync_cycles=150,
                  host_bytes_per_s=16e9, host_latency_s=5e-6,
                  code_bytes_per_tile=8 * 1024)

TARGETS = {"mk2": MK2, "ipu2": MK2, "test": TEST_IPU}


def default_target():
    """The target named by POPTORCHSIM_IPU_MODEL_VERSION, Mk2 by default."""
    name = os.environ.get("POPTORCHSIM_IPU_MODEL_VERSION", "mk2").lower()
    if os.environ.get("POPTORCHSIM_SMALL_IPU_MODEL", "") not in ("", "0"):
        name = "test"
    if name not in TARGETS:
        raise Error(f"Unknown IPU model version {name!r} in "
                    f"POPTORCHSIM_IPU_MODEL_VERSION; choose one of {sorted(TARGETS)}")
    return TARGETS[name]
