"""``Options`` setters that tune Poplar's compiler or PopTorch's IR printer
on hardware; on the simulator they are validated and recorded as PopTorch
records them, so that programs calling them run unchanged.

``options.py`` mixes ``_CompilerOptions`` into ``Options``; nothing here
imports it.
"""
import logging

from .. import enums

logger = logging.getLogger("poptorchsim")

# PopTorch's ``_options_impl.default_source_location_excludes``.
DEFAULT_SOURCE_LOCATION_EXCLUDES = ("install/poptorch", "site-packages/torch",
                                    "site-packages/poptorch")


def _check_bool(name, value):
    """PopTorch's text for an option of the wrong type (``OptionsDict.set``)."""
    if not isinstance(value, bool):
        raise AssertionError(f"Unexpected type {type(value)} for option {name}. "
                             "Expected <class 'bool'>")


class _CompilerOptions:
    """Mixed into ``Options`` (an ``_OptionsDict``)."""

    def enableStableNorm(self, enabled):
        """Use the stable (two-pass, slower, more accurate) variance in norm
        operators (batch, group, layer norm).  Stored as PopTorch stores it,
        ``_Popart.options["enableStableNorm"]``.  The simulator computes norms
        with PyTorch's own kernels, which are already stable, so results are
        the same either way."""
        _check_bool("enableStableNorm", enabled)
        self._Popart.set("enableStableNorm", enabled)
        return self

    def inputReplicaGrouping(self, input_group_size, input_group_type):
        """Splits the input batches between groups of ``input_group_size``
        replicas: the replicas of a group take the same data, so each call
        takes ``replicationFactor / input_group_size`` replicas' worth of
        inputs (``DataLoader`` and the batch check follow).  Set
        ``replicationFactor`` first.  ``input_group_type``: a
        ``poptorch.CommGroupType``, not ``All``; ``NoGrouping`` means groups
        of one replica."""
        if not isinstance(input_group_type, enums.CommGroupType):
            raise AssertionError(
                f"Unexpected type {type(input_group_type)} for option input_cgt. "
                "Expected <enum 'CommGroupType'>")
        if isinstance(input_group_size, bool) or not isinstance(input_group_size, int):
            raise AssertionError(f"Unexpected type {type(input_group_size)} for option "
                                 "input_group_size. Expected <class 'int'>")
        if input_group_type == enums.CommGroupType.NoGrouping:
            input_group_size = 1
            input_group_type = enums.CommGroupType.Consecutive
        if input_group_type == enums.CommGroupType.All:
            raise ValueError("input_group_type cannot be All")
        if input_group_size < 1:
            raise ValueError(f"input_group_size must be a positive integer, got "
                             f"{input_group_size}")
        if self.replication_factor < input_group_size:
            raise ValueError("input_group_size cannot be larger than replication_factor")
        if self.replication_factor % input_group_size != 0:
            raise ValueError("input_group_size must be a factor of replication_factor")
        return self.set(input_group_size=input_group_size, input_cgt=input_group_type)

    # -- source locations in the IR ------------------------------------------------
    @property
    def source_location_excludes(self):
        """Frames whose file contains one of these strings are skipped when
        an IR op's source location is chosen (PopTorch's IR printer)."""
        return list(vars(self).get("_source_location_excludes",
                                   DEFAULT_SOURCE_LOCATION_EXCLUDES))

    def sourceLocationExcludes(self, excludes):
        """Replaces the list of source-location exclusions.  Recorded; the
        simulator's IR already names the first frame outside torch and
        poptorchsim, so these change nothing it prints."""
        if isinstance(excludes, str) or not all(isinstance(e, str) for e in excludes):
            raise AssertionError("sourceLocationExcludes expects a list of strings "
                                 f"(got {excludes!r})")
        self._check_not_frozen()
        object.__setattr__(self, "_source_location_excludes", list(excludes))
        return self

    def appendToLocationExcludes(self, *excludes):
        """Adds ``excludes`` (strings) to the source-location exclusions."""
        if not all(isinstance(e, str) for e in excludes):
            raise AssertionError("appendToLocationExcludes expects strings "
                                 f"(got {excludes!r})")
        return self.sourceLocationExcludes(self.source_location_excludes + list(excludes))
