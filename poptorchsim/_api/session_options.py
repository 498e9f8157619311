"""PopTorch's options as its backend takes them: ``Options.toDict()`` (the
backend's parse of that dictionary is ``runtime/settings/session_options.py``).

``Options.toDict()`` merges every option into one flat dictionary, as
PopTorch's does: the execution strategy's backend options, the PopART
session options (``Options._Popart``, with those the precision and
synthetic-data setters write there), the options of ``Options`` itself and
of its training, distributed and tensor-location groups, and the progress
bar's callback.  PopTorch's backend (its ``SessionOptionsParser``) reads
that dictionary option by option: a value is a boolean, a float, an int, a
string, a list (each element added) or a dictionary (each key set), and
goes to the option of that name and kind; an unknown name is an error,
``Unknown <kind> option <name>``, and so is a value of another type,
``Unknown value type <type> for option <name>``.  At debug level each
option set is logged, ``poptorch.Options set <name> to value <value>``
(``set <name>[<key>] to <value>`` in a dictionary, ``added <value> to
<name>`` in a list).  ``poptorch_core._validateOptions`` runs that parse,
and every compile runs it too, so a program sees the same debug lines."""
import enum

# options of poptorchsim's own (no PopTorch counterpart), left out of the dictionary
_OWN = ("relax_optimizer_checks", "show_compilation_progress_bar", "synthetic_data",
        "convolution_dithering", "ipu_model_version", "random_streams")


def _plain(value):
    """An enum as its value, containers walked (PopTorch stores values)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return type(value)(_plain(v) for v in value)
    return value


def to_dict(options, output_mode=None):
    """``Options.toDict()``: every option in one flat dictionary, as PopTorch's.
    ``output_mode``: the mode a model resolved ``OutputMode.Default`` to."""
    o = options
    if o.output_mode == 4 and output_mode is None:          # OutputMode.Default
        raise AssertionError("An output mode must be picked before serialisation")
    out = dict(o._execution_strategy.backendOptions())
    out.update(_plain(o._popart.options))
    if "synthetic_data" in o._values:
        out["syntheticDataMode"] = 2 if o._values["synthetic_data"] else 0
    for group in (o, o._training, o._distributed, o._tensor_locations):
        for key, value in group._values.items():
            if key in _OWN:
                continue
            if key == "auto_loss_scaling":
                if value:
                    out["automaticLossScalingSettings.enabled"] = True
                continue
            if key == "num_io_tiles":
                if value:
                    out["numIOTiles"] = value
                continue
            assert key not in out, "Can't merge dictionaries, they have some keys in common"
            out[key] = _plain(value)
    if output_mode is not None and out.get("output_mode") == 4:
        out["output_mode"] = int(output_mode)
    if o._values.get("show_compilation_progress_bar", True):
        out["compilation_progress_bar_fn"] = _progress
    return out


def _progress(progress, total):
    """The compilation progress callback PopTorch's dictionary carries."""


