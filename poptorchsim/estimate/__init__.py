"""The estimate wing: what a program costs on the IPU.

Targets (``targets``), the cost model's constants with their units and
sources (``constants``), Poplar-style plans for convolutions and matrix
products (``conv_plan``), per-op cycles and temporary bytes (``cost``), and
the cost walk over the control program with the pipeline schedule
(``program_cost``).  It reads the IR and never the host-execution wing
(``machine/``: the engine, code generation, kernels, fp16 emulation), which
never reads it: one program, walked twice.
"""
