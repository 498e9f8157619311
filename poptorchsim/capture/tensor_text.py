"""The text ``ipu_print_tensor`` prints: Poplar's ``PrintTensorFmt`` layout.

A tensor prints as nested brackets, one line per innermost row, each level
indented by one space, its elements aligned to a common width::

    title: (
     (1.4962566, 1.7682219)
     (1.0884774, 1.1320305)
    )

Options (PopTorch's arguments): ``summarise_threshold`` (above that many
elements only ``edge_items`` at each end of every dimension are shown, with
``...`` between; 0 shows all), ``max_line_width`` (longer rows break after a
separator; 0 never breaks), ``digits`` (significant digits; 0 prints each
element unaligned), ``float_format`` ("auto", "fixed", "scientific" or
"none"), ``separator`` and the brackets.
"""
import math

FLOAT_FORMATS = ("auto", "fixed", "scientific", "none")
ELLIPSIS = "..."


def _scientific_needed(values):
    """numpy's rule for "auto": scientific when the finite magnitudes span
    more than three decades, or reach 1e8, or fall below 1e-4."""
    mags = [abs(v) for v in values if math.isfinite(v) and v != 0]
    if not mags:
        return False
    hi, lo = max(mags), min(mags)
    return hi >= 1e8 or lo < 1e-4 or hi / lo > 1e3


def _float_text(values, digits, float_format):
    """Each value as text, in the format the options ask for."""
    if float_format == "none" or digits == 0:
        return [f"{v:.{digits or 6}g}" if math.isfinite(v) else str(v) for v in values]
    if float_format == "auto":
        float_format = "scientific" if _scientific_needed(values) else "fixed"
    if float_format == "scientific":
        return [f"{v:.{max(digits - 1, 0)}e}" if math.isfinite(v) else str(v)
                for v in values]
    finite = [abs(v) for v in values if math.isfinite(v)]
    int_digits = len(str(int(max(finite)))) if finite else 1
    decimals = max(digits - int_digits, 0)
    return [f"{v:.{decimals}f}" if math.isfinite(v) else str(v) for v in values]


def _shown(size, edge_items, summarise):
    """Indices of one dimension that are printed; None marks the ellipsis."""
    if summarise and size > 2 * edge_items:
        return list(range(edge_items)) + [None] + list(range(size - edge_items, size))
    return list(range(size))


def _row_lines(items, indent, fmt):
    """One innermost row, broken after a separator when longer than the width."""
    sep, width = fmt["separator"], fmt["max_line_width"]
    lines, line = [], indent + fmt["open_bracket"]
    cont = indent + " " * (len(fmt["open_bracket"]) + 1)
    for k, item in enumerate(items):
        piece = item + (sep if k + 1 < len(items) else fmt["close_bracket"])
        if width > 0 and k > 0 and len(line) + len(piece) > width:
            lines.append(line.rstrip())
            line = cont
        line += piece
    if not items:
        line += fmt["close_bracket"]
    lines.append(line)
    return lines


def _block(index, shape, depth, text_of, fmt, summarise):
    """The lines of the sub-tensor at ``index`` (a tuple of leading indices)."""
    indent = " " * depth
    size = shape[len(index)]
    shown = _shown(size, fmt["edge_items"], summarise)
    if len(index) + 1 == len(shape):
        items = [ELLIPSIS if i is None else text_of[index + (i,)] for i in shown]
        return _row_lines(items, indent, fmt)
    lines = [indent + fmt["open_bracket"]]
    for i in shown:
        if i is None:
            lines.append(indent + " " + ELLIPSIS)
        else:
            lines += _block(index + (i,), shape, depth + 1, text_of, fmt, summarise)
    lines.append(indent + fmt["close_bracket"])
    return lines


def format_tensor(tensor, title="", summarise_threshold=1000, edge_items=3,
                  max_line_width=80, digits=4, float_format="auto", separator=", ",
                  open_bracket="(", close_bracket=")"):
    """``tensor`` as ``ipu_print_tensor`` prints it (without the final newline)."""
    fmt = {"separator": separator, "max_line_width": max_line_width,
           "edge_items": edge_items, "open_bracket": open_bracket,
           "close_bracket": close_bracket}
    t = tensor.detach().cpu()
    shape = tuple(t.shape)
    summarise = summarise_threshold > 0 and t.numel() > summarise_threshold
    indices = _printed_indices(shape, edge_items, summarise)
    flat = [t[i].item() for i in indices]
    if t.is_floating_point():
        texts = _float_text([float(v) for v in flat], digits, float_format)
    else:
        texts = [str(int(v)) for v in flat]
    if digits > 0 and float_format != "none":
        width = max((len(s) for s in texts), default=0)
        texts = [s.rjust(width) for s in texts]
    text_of = dict(zip(indices, texts))
    prefix = f"{title}: " if title else ""
    if not shape:
        return prefix + text_of[()]
    lines = _block((), shape, 0, text_of, fmt, summarise)
    return prefix + "\n".join(lines)


def _printed_indices(shape, edge_items, summarise):
    """Every index tuple that is printed, in order."""
    indices = [()]
    for size in shape:
        shown = [i for i in _shown(size, edge_items, summarise) if i is not None]
        indices = [idx + (i,) for idx in indices for i in shown]
    return indices


def check_format_arguments(summarise_threshold, edge_items, max_line_width, digits,
                           float_format, separator, open_bracket, close_bracket):
    """Raises ValueError naming the first bad ``ipu_print_tensor`` argument."""
    for name, value in (("summarise_threshold", summarise_threshold),
                        ("edge_items", edge_items), ("max_line_width", max_line_width),
                        ("digits", digits)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"ipu_print_tensor: {name} must be a non-negative integer, "
                             f"got {value!r}")
    if float_format not in FLOAT_FORMATS:
        raise ValueError(f"ipu_print_tensor: float_format must be one of "
                         f"{', '.join(FLOAT_FORMATS)}, got {float_format!r}")
    for name, value in (("separator", separator), ("open_bracket", open_bracket),
                        ("close_bracket", close_bracket)):
        if not isinstance(value, str):
            raise ValueError(f"ipu_print_tensor: {name} must be a string, got {value!r}")

