"""runtime/planning/: beyond PopTorch: which configuration a model should train
in, and how to split it."""
