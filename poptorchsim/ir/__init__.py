"""The IPU graph IR (``graph``), its op set and cost classes (``ops``),
its text form (``printer``) and its verifier (``verify``)."""
from . import printer  # noqa: F401 - registers the text forms of graphs and programs
