#!/usr/bin/env python3
"""PopTorch's own test suite through the import alias: pass rate per file.

Runs each ``tests/*_test.py`` of a PopTorch checkout (graphcore/poptorch)
with ``python -m poptorchsim.run -m pytest`` (``import poptorch`` resolves to
poptorchsim), one pytest process per file under a time limit, and prints a
table: passed, failed, errors, skipped per file, and the pass rate of the
tests that ran (passed over passed + failed + errors).  ``--json`` writes
the per-test outcomes, for comparing two runs.

    git --git-dir=<poptorch mirror> archive HEAD tests | tar x -C DIR
    python benchmarks/poptorch_suite.py DIR/tests [--files a_test.py ...]
        [--limit 1200] [--workers 2] [--json out.json]
"""
import argparse
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET


def run_file(tests_dir, name, limit, out_dir):
    """(name, {test id: outcome}, seconds, finished): one file's run."""
    xml = os.path.join(out_dir, name + ".xml")
    cmd = [sys.executable, "-m", "poptorchsim.run", "-m", "pytest", "-q", "-p",
           "no:cacheprovider", "-o", "junit_family=xunit1", f"--junitxml={xml}", name]
    # PopTorch's tests start ``python3 -m pytest`` themselves: this interpreter first
    # on PATH, so that they run where pytest and poptorchsim are installed
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable),
                                                 os.environ.get("PATH", "")]))
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tests_dir, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    try:
        proc.wait(timeout=limit)
        finished = True
    except subprocess.TimeoutExpired:       # the launcher's workers too
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        finished = False
    outcomes = {}
    if os.path.exists(xml):
        for case in ET.parse(xml).getroot().iter("testcase"):
            tid = f"{case.get('classname')}::{case.get('name')}"
            tags = {child.tag for child in case}
            outcomes[tid] = ("failed" if "failure" in tags else "error" if "error" in tags
                             else "skipped" if "skipped" in tags else "passed")
    return name, outcomes, time.perf_counter() - start, finished


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tests_dir")
    p.add_argument("--files", nargs="*")
    p.add_argument("--limit", type=float, default=1200.0, help="seconds per file")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    files = args.files or sorted(f for f in os.listdir(args.tests_dir) if f.endswith("_test.py"))
    rows = {}
    with tempfile.TemporaryDirectory() as out, \
            concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
        jobs = [pool.submit(run_file, args.tests_dir, f, args.limit, out) for f in files]
        for job in concurrent.futures.as_completed(jobs):
            name, outcomes, seconds, finished = job.result()
            rows[name] = {"outcomes": outcomes, "seconds": seconds, "finished": finished}
            counts = {k: sum(v == k for v in outcomes.values())
                      for k in ("passed", "failed", "error", "skipped")}
            print(f"{name:<40} {counts['passed']:>5} passed {counts['failed']:>4} failed "
                  f"{counts['error']:>4} errors {counts['skipped']:>4} skipped "
                  f"{seconds:>6.0f} s{'' if finished else '  (time limit)'}", flush=True)
    total = {k: sum(v == k for r in rows.values() for v in r["outcomes"].values())
             for k in ("passed", "failed", "error", "skipped")}
    ran = total["passed"] + total["failed"] + total["error"]
    unfinished = [n for n, r in rows.items() if not r["finished"]]
    print(f"\n{total['passed']} of {ran} tests that ran passed "
          f"({100 * total['passed'] / max(ran, 1):.1f}%); {total['skipped']} skipped; "
          f"files past the time limit: {', '.join(unfinished) or 'none'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
