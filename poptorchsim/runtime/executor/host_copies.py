"""The random-number state of a compiled model, as PopTorch names it
(``rng_state``).

The simulated device draws its random numbers (dropout, ``torch.rand`` in
``forward``) from PyTorch's CPU generator, so its state is that generator's:
``rng_state`` is ``[seed] + torch.get_rng_state()`` as a list of ints, the
layout PopTorch's ``[seed] + getRngState()`` has.
"""
import torch

from ...errors import Error


def rng_state(options):
    """``[seed, *state]`` (ints); the seed is ``Options.randomSeed``'s, else
    PyTorch's initial seed."""
    seed = getattr(options, "random_seed", None)
    if seed is None:
        seed = torch.initial_seed()
    return [int(seed)] + torch.get_rng_state().tolist()


def set_rng_state(state):
    """Restores a state read from ``rng_state`` (or saved by ``save(...,
    save_rng_state=True)``)."""
    expected = torch.get_rng_state().numel() + 1
    if not isinstance(state, (list, tuple)) or len(state) != expected or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in state):
        raise Error(f"rng_state expects the list of {expected} ints that "
                    "model.rng_state returns ([seed, *state])")
    torch.set_rng_state(torch.tensor(list(state[1:]), dtype=torch.uint8))
