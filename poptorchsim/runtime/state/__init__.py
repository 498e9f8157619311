"""runtime/state/: the device copy of a model's state and the host's memory
while programs run."""
