"""`python SCRIPT ARGS...` for the tests' build and oracle scripts, each run forked from a process that
imported the script's libraries once (`script_server.py`): importing torch, transformers and the
quantization tool a script drives takes 5 to 7 s, more than most of its runs on a test model take, and
a fresh test machine runs about a hundred of them."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

__all__ = ["run_script"]


class _ScriptServer:
    """One `script_server.py` process for one script: started at the first run, ended with this process."""

    def __init__(self, script: Path) -> None:
        self.script = script
        self.log = Path(tempfile.mkdtemp(prefix="ember-script-")) / "server.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("script_server.py")), str(script)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        self.lock = threading.Lock()
        self.runs = 0
        assert self.process.stdout is not None
        self.ready = self.process.stdout.readline().strip() == "ready"  # else its imports started threads

    def run(self, args: list[str]) -> None:
        if not self.ready:
            subprocess.run([sys.executable, str(self.script), *args], check=True)
            return
        with self.lock:
            self.runs += 1
            log = self.log.with_name(f"run{self.runs}.log")
            request = {"argv": args, "env": dict(os.environ), "cwd": os.getcwd(), "log": str(log)}
            assert self.process.stdin is not None and self.process.stdout is not None
            try:
                self.process.stdin.write(json.dumps(request) + "\n")
                self.process.stdin.flush()
                answer = self.process.stdout.readline()
            except BrokenPipeError:
                answer = ""
            if not answer:  # the server itself ended: its import failed, say
                raise RuntimeError(f"{self.script.name} could not be run: {self.log.read_text()[-3000:]}")
            code = int(answer)
            if code:  # the run's output, for the failing test's report
                output = log.read_text(errors="replace") if log.exists() else ""
                sys.stderr.write(output)
                raise subprocess.CalledProcessError(code, [sys.executable, str(self.script), *args], output)

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        shutil.rmtree(self.log.parent, ignore_errors=True)


_SERVERS: dict[Path, _ScriptServer] = {}


def run_script(script: Path, *args: str | Path) -> None:
    """`python script args...` with `check=True`, in a child forked from a process that imported `script`
    once (`script_server.py`): a build script's imports (torch, transformers, the quantization tool)
    cost more than most of its builds of a test model. Where processes cannot fork, a new process."""
    if not hasattr(os, "fork"):
        subprocess.run([sys.executable, str(script), *map(str, args)], check=True)
        return
    script = script.resolve()
    if script not in _SERVERS:
        _SERVERS[script] = _ScriptServer(script)
    _SERVERS[script].run([str(a) for a in args])


@atexit.register
def _close_servers() -> None:
    for server in _SERVERS.values():
        server.close()
