"""Command line: ``python -m poptorchsim report DIR`` prints the simulation
reports written under DIR by ``Options.enableProfiling(DIR)`` (or
``POPLAR_ENGINE_OPTIONS='{"autoReport.all":"true","autoReport.directory":"DIR"}'``),
with the five cost-model constants each estimate depends on most
(``executor.estimateSensitivity()``);
``python -m poptorchsim ops DIR`` lists the ATen operations each model uses,
with their cost class and cycles; ``python -m poptorchsim plan SCRIPT`` searches
the IPU configurations SCRIPT's model could train in (``runtime/planning/planner.py``);
``python -m poptorchsim validate`` compares the estimate with Poplar's own IPU
Model figures layer by layer (``validation``), so you know how far to trust it."""
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


def _plan(args):
    """Runs SCRIPT (which defines ``model`` and ``example_inputs``, and may
    define ``optimizer`` and ``options``) and plans its configurations."""
    import runpy

    from .runtime.planning.planner import plan
    sys.argv = [args.script] + list(args.script_args)
    try:
        space = runpy.run_path(args.script, run_name="__poptorchsim_plan__")
    except FileNotFoundError:
        print(f"poptorchsim plan: no such script {args.script!r}", file=sys.stderr)
        return 2
    missing = [n for n in ("model", "example_inputs") if n not in space]
    if missing:
        print(f"poptorchsim plan: {args.script} must define {' and '.join(missing)} at its "
              "top level (the model and one micro-batch of inputs, as a tuple); it may also "
              "define optimizer and options.", file=sys.stderr)
        return 2

    def ints(text):
        return tuple(int(v) for v in text.split(",")) if text else None
    search = {"micro_batches": ints(args.micro_batches) or (1, 2, 4, 8, 16, 32),
              "global_batch": args.global_batch,
              "ipus_per_replica": ints(args.ipus_per_replica)}
    if args.amps:
        search["amps"] = tuple(float(v) for v in args.amps.split(","))
    result = plan(space["model"], tuple(space["example_inputs"]), args.ipus,
                  space.get("optimizer"), space.get("options"), **search)
    print(result.table(limit=args.top))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "plan.json"), "w") as f:
        json.dump(result.to_json(), f, indent=1)
    png = result.plot(os.path.join(args.out, "plan.png"))
    print(f"plot: {png}; all configurations: {os.path.join(args.out, 'plan.json')}")
    return 0 if result.best is not None else 1


def _validate(args):
    from . import validation
    table = validation.reference()["rows"]
    if args.kinds:
        kinds = set(args.kinds.split(","))
        unknown = kinds - set(validation.KINDS)
        if unknown:
            print(f"poptorchsim validate: unknown kind(s) {', '.join(sorted(unknown))}; "
                  f"choose from {', '.join(validation.KINDS)}", file=sys.stderr)
            return 2
        table = [r for r in table if validation.kind_of(r) in kinds]
    rows = validation.compare([r["name"] for r in table], progress=True)
    source = validation.reference()["source"]
    print(f"poptorchsim against Poplar's IPU Model ({source['target']}, graphcore/poplibs "
          f"{source['commit'][:8]} {source['table']}), {len(rows)} layers; error = "
          "max(r, 1/r) - 1 of r = ours / Poplar's")
    if args.rows:
        print(validation.row_table(rows))
        print()
    print(validation.summary_table(rows, worst=args.worst))
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
    command = commands.add_parser(
        "plan", help="search the IPU configurations a model could train in",
        description="Run SCRIPT (it defines model and example_inputs, one micro-batch; "
                    "optionally optimizer and options), then compile the model under the "
                    "configurations of --ipus IPUs a Graphcore engineer would try and print "
                    "them ranked by estimated throughput, with why the rejected ones fail. "
                    "Writes plan.json and plan.png (throughput against memory headroom).")
    command.add_argument("script", metavar="SCRIPT")
    command.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS")
    command.add_argument("--ipus", type=int, default=16)
    command.add_argument("--global-batch", type=int, default=None,
                         help="samples per weight update (sets the gradient accumulation)")
    command.add_argument("--micro-batches", default="", help="comma-separated, e.g. 1,2,4,8")
    command.add_argument("--ipus-per-replica", default="", help="comma-separated, e.g. 4,8")
    command.add_argument("--amps", default="", help="available memory proportions to try")
    command.add_argument("--top", type=int, default=15, help="fitting rows to print")
    command.add_argument("--out", default="plan_out", help="directory for plan.json, plan.png")
    command.set_defaults(run=_plan)
    command = commands.add_parser(
        "validate", help="compare the estimate with Poplar's own figures, layer by layer",
        description="Rebuild each of Poplar's benchmark layers (poplibs' IpuModel2 rows: "
                    "convolutions, fully connected, gemm, LSTM, GRU, pooling, reductions, "
                    "embeddings; the ResNet-50, VGG-16 and AlexNet rows held out) as a "
                    "one-layer program, compile it without weights and print, per kind, "
                    "how far our cycles and memory are from Poplar's.")
    command.add_argument("--kinds", default="", help="comma-separated kinds (default: all)")
    command.add_argument("--rows", action="store_true", help="print every row too")
    command.add_argument("--worst", type=int, default=5, help="worst rows to name")
    command.set_defaults(run=_validate)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
