"""Runs one Python script many times, each run as `python SCRIPT ARGS...` would, without paying for its
imports each time: this process runs SCRIPT's top level once and imports the modules its `PRELOAD` names
(torch, transformers and the quantization tool the script drives take 5 to 7 s to import, more than most
builds of a test model take), then forks a child for each request, which runs the script as `__main__`
with the request's arguments, environment and working directory, its output written to the request's
log file. A child starts from the state the import left, never from another run's.

It first answers `ready` on stdout, or `threads NAMES` and ends if the imports started threads (see
`main`). Requests are JSON lines on stdin, `{"argv": [...], "env": {...}, "cwd": "...", "log": "..."}`;
each is answered on stdout with the child's exit status as `python` reports it (a signal's number
negated).
`script_runs.run_script` keeps one such process per script and test process."""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import threading
import traceback
from pathlib import Path


def _child(script: str, request: dict) -> int:  # type: ignore[type-arg]
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = [script, *request["argv"]]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def main() -> int:
    script = str(Path(sys.argv[1]).resolve())
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything the import prints goes to this process's stderr, not among the answers
    sys.path.insert(0, str(Path(script).parent))  # as `python SCRIPT` puts the script's folder first
    names = runpy.run_path(script, run_name="script_server_preload")
    for module in names.get("PRELOAD", ()):  # what the script imports where it uses it
        importlib.import_module(module)
    # A child has only the thread that forked it: a Python thread an import started (a worker pool, say)
    # would not exist in it, and a run waiting on one would hang. So none may have started.
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    answers.write(f"threads {' '.join(threads)}\n" if threads else "ready\n")
    answers.flush()
    if threads:
        return 1
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(script, request)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        answers.write(f"{os.waitstatus_to_exitcode(status)}\n")
        answers.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
