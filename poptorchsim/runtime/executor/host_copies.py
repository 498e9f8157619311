"""``PoplarExecutor``'s random-number state and lazy weight copies, as
PopTorch names them (``rng_state``, ``copyWeightsToHostIfNeeded``), and
``_executable``, which applications test to see whether a model is compiled
(vision/cnns: ``if inference_model._executable: attachToDevice()``).

The simulated device draws its random numbers (dropout, ``torch.rand`` in
``forward``) from PyTorch's CPU generator, so its state is that generator's:
``rng_state`` is ``[seed] + torch.get_rng_state()`` as a list of ints, the
layout PopTorch's ``[seed] + getRngState()`` has.  ``executor.py`` mixes
``_HostCopies`` into ``PoplarExecutor``.
"""
import torch

from ...errors import Error


class _HostCopies:
    """Needs ``_require_compiled``, ``_compiled`` and ``_options`` from the
    executor."""

    @property
    def _executable(self):
        """The compiled program, or None before compilation and after
        ``destroy()`` (PopTorch's handle on its Poplar executable)."""
        return vars(self).get("_compiled")

    @property
    def rng_state(self):
        """The random number generator's seed and state of the compiled
        model: ``[seed, *state]`` (ints); the seed is
        ``Options.randomSeed``'s, else PyTorch's initial seed."""
        self._require_compiled()
        seed = getattr(self._options, "random_seed", None)
        if seed is None:
            seed = torch.initial_seed()
        return [int(seed)] + torch.get_rng_state().tolist()

    @rng_state.setter
    def rng_state(self, state):
        """Restores a state read from ``rng_state`` (or saved by
        ``save(..., save_rng_state=True)``)."""
        self._require_compiled()
        expected = torch.get_rng_state().numel() + 1
        if not isinstance(state, (list, tuple)) or len(state) != expected or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in state):
            raise Error(f"rng_state expects the list of {expected} ints that "
                        "model.rng_state returns ([seed, *state])")
        torch.set_rng_state(torch.tensor(list(state[1:]), dtype=torch.uint8))

    def copyWeightsToHostIfNeeded(self):
        """True if the host's weights were out of date and have been updated,
        False if they were up to date.  On the CPU the trained weights are
        the model's own after every call (always False); on a CUDA host
        device they are copied when the model is read (``lazy_weights.py``)
        or here."""
        weights = vars(self).get("_weights")
        if weights is None or not weights.dirty or vars(self).get("_compiled") is None:
            return False
        weights.download(self._compiled, fresh=False)
        return True
