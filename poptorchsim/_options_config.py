"""``Options.loadFromFile``: one option call a line, PopTorch's file format.

Each line is what would follow ``options.`` in Python
(``deviceIterations(4)``); blank lines and lines starting with ``#`` are
skipped, and an inline ``# comment`` is Python's own.  The lines run in
order, so a later file overrides only the options it sets.  A line that
does not parse raises ``poptorch.options.ConfigFileError`` naming the line
and the file, as PopTorch's ``_options_config.py`` does.
"""
import os

# Python 3.10+ says "'(' was never closed" where the Python PopTorch was
# written for said "unexpected EOF while parsing"; PopTorch's text is kept.
_EOF_DETAILS = ("was never closed", "unexpected EOF")


def parse_and_set_options(options, filepath):
    from . import options as _options_module
    import poptorchsim
    commands = []
    with open(filepath) as f:
        filename = os.path.basename(f.name)
        for line in f:
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            commands.append("options." + stripped)
    code = "\n".join(commands)
    try:
        compiled = compile(code, filename, "exec")
    except SyntaxError as err:
        detail = err.args[0]
        if any(s in detail for s in _EOF_DETAILS):
            detail = "unexpected EOF while parsing"
        line = (err.text or "").rstrip("\n")
        raise _options_module.ConfigFileError(
            f"{type(err).__name__} at line {err.lineno} of {filename}: {detail}\n"
            f"> {line}") from None
    exec(compiled, {}, {"poptorch": poptorchsim, "options": options})  # noqa: S102
