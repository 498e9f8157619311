"""Command line: ``python -m poptorchsim report DIR`` prints the simulation
reports written under DIR by ``Options.enableProfiling(DIR)`` (or
``POPLAR_ENGINE_OPTIONS='{"autoReport.all":"true","autoReport.directory":"DIR"}'``),
with the five cost-model constants each estimate depends on most
(``executor.estimateSensitivity()``);
``python -m poptorchsim ops DIR`` lists the ATen operations each model uses,
with their cost class and cycles."""
import argparse
import json
import os
import sys


def _report(args):
    from .profiling import find_reports, op_table, summary
    show = op_table if args.command == "ops" else summary
    if not os.path.isdir(args.directory):
        print(f"poptorchsim report: {args.directory!r} is not a directory", file=sys.stderr)
        return 2
    paths = find_reports(args.directory)
    if not paths:
        print(f"poptorchsim report: no profile.json found in {args.directory!r} or its "
              "subdirectories. Compile a model with Options().enableProfiling(DIR), or set "
              "POPLAR_ENGINE_OPTIONS='{\"autoReport.all\":\"true\","
              "\"autoReport.directory\":\"DIR\"}', then point this at DIR.", file=sys.stderr)
        return 1
    for i, path in enumerate(paths):
        try:
            with open(path) as f:
                report = json.load(f)
            text = show(report)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"poptorchsim report: cannot read {path}: {exc!r}", file=sys.stderr)
            return 1
        if i:
            print()
        html = os.path.join(os.path.dirname(path), "index.html")
        print(f"== {os.path.dirname(path)}" + (f" (open {html})" if os.path.exists(html) else ""))
        print(text)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m poptorchsim",
                                     description="poptorchsim command line tools")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text, description in (
            ("report", "print the simulation reports found under a directory",
             "Print a summary of every simulation report (profile.json) in DIR and its "
             "subdirectories: a model's report directory, or the profile root holding one "
             "subdirectory per model. Each summary ends with the five cost-model constants "
             "whose +-20% moves the samples/s estimate most, so you know how far to "
             "trust it."),
            ("ops", "list the ATen operations of every report under a directory",
             "For every simulation report (profile.json) in DIR and its subdirectories: "
             "each ATen operation the program holds, how often, its cost class and its "
             "cycles per call, costliest first.")):
        command = commands.add_parser(name, help=help_text, description=description)
        command.add_argument("directory", metavar="DIR")
        command.set_defaults(run=_report)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
