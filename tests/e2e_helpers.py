"""Helpers for end-to-end tests that spawn ``blink serve`` / ``blink engine`` processes.

Every process is started as ``python -m blink.cli ...`` with its output in a log file (so a
failing test can show it), and stopped by pid (never by name). ``/dev/shm`` checks look only at
the segments a given engine pid created (``blink-<pid>-...``): other engines may be running on
the same machine.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import httpx

from blink.supervision import child_processes

BLINK = [sys.executable, "-m", "blink.cli"]
SHM_DIR = Path("/dev/shm")
SERVE_READY = "Blink is serving"
FRONTEND_READY = "Blink frontend ready"
ENGINE_READY = "BLINK_ENGINE_READY "
# Loading SmolLM2 takes ~10 s on an idle core; the test machine's cores are shared.
START_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.05,
               what: str = "condition") -> object:
    """Poll ``predicate`` until it returns something truthy; AssertionError on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def child_pids(pid: int) -> list[int]:
    """Direct live children of ``pid``."""
    return child_processes(pid)


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] not in ("Z", "X")


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def segments_of(pid: int) -> list[str]:
    """The loopback shared-memory segments created by process ``pid`` that still exist."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"blink-{pid}-"))
    except OSError:
        return []


class BlinkProcess:
    """One ``python -m blink.cli ARGS`` process with its stdout+stderr in a temp file."""

    def __init__(self, args: Sequence[str], name: str = "blink", env: dict | None = None,
                 capture_stdout: bool = False) -> None:
        self.args = list(args)
        self.name = name
        fd, path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(path)
        self._log = open(self.log_path, "w")
        full_env = dict(os.environ)
        full_env.setdefault("TOKENIZERS_PARALLELISM", "false")
        full_env["PYTHONUNBUFFERED"] = "1"
        if env:
            full_env.update(env)
        self.proc = subprocess.Popen(
            [*BLINK, *self.args], stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
            stdin=subprocess.DEVNULL,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_for_output(self, pattern: str, timeout_s: float = START_TIMEOUT_S) -> re.Match:
        """Wait for ``pattern`` (a regex) in the log; fail early if the process exits."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        while True:
            match = regex.search(self.log())
            if match:
                return match
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"{self.name} exited with {self.proc.returncode} before printing "
                    f"{pattern!r}; its output:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} did not print {pattern!r} within "
                                     f"{timeout_s:g} s; its output:\n{self.tail()}")
            time.sleep(0.1)

    def tail(self, chars: int = 4000) -> str:
        text = self.log()
        # tqdm progress bars redraw with \r: keep only the last state of each line.
        text = "\n".join(line.rsplit("\r", 1)[-1] for line in text.splitlines())
        return text[-chars:]

    def send(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout_s)

    def stop(self, signum: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Signal and wait; SIGKILL if it does not exit in time. Returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


class ServeProcess(BlinkProcess):
    """``blink serve ...`` (engine + frontend under the supervisor) on a free HTTP port."""

    def __init__(self, *flags: str, port: int | None = None, api_key: str | None = None,
                 name: str = "blink-serve") -> None:
        self.port = port or free_port()
        self.api_key = api_key
        args = ["serve", "--port", str(self.port), *flags]
        if api_key:
            args += ["--api-key", api_key]
        super().__init__(args, name=name)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.engine_pid: int | None = None
        self.frontend_pid: int | None = None

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> "ServeProcess":
        self.wait_for_output(re.escape(SERVE_READY), timeout_s)
        for pid in child_pids(self.pid):
            argv = cmdline(pid)
            if "engine" in argv:
                self.engine_pid = pid
            elif "--frontend-only" in argv:
                self.frontend_pid = pid
        assert self.engine_pid and self.frontend_pid, (
            f"cannot find the children of blink serve (pid {self.pid}): {child_pids(self.pid)}")
        return self

    def stop(self, signum: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        status = super().stop(signum, timeout_s)
        for pid in (self.engine_pid, self.frontend_pid):  # never leave a child behind
            if pid and pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        return status


class EngineProcess(BlinkProcess):
    """``blink engine --listen 127.0.0.1:PORT --bootstrap-secret-file F ...`` (F, a fresh
    file in a private temp dir, is :attr:`secret_file`: hand it to the frontend)."""

    def __init__(self, *flags: str, port: int | None = None, name: str = "blink-engine") -> None:
        self.bootstrap_port = port or free_port()
        self.secret_file = str(Path(tempfile.mkdtemp(prefix="blink-secret-")) / "bootstrap.secret")
        super().__init__(["engine", "--listen", f"127.0.0.1:{self.bootstrap_port}",
                          "--bootstrap-secret-file", self.secret_file, *flags], name=name)
        self.address = f"127.0.0.1:{self.bootstrap_port}"

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> "EngineProcess":
        match = self.wait_for_output(re.escape(ENGINE_READY) + r"(\S+)", timeout_s)
        self.address = match.group(1)
        return self


class FrontendProcess(BlinkProcess):
    """``blink serve --frontend-only --engine ADDR`` on a free HTTP port."""

    def __init__(self, engine_address: str, *flags: str, port: int | None = None,
                 name: str = "blink-frontend", env: dict | None = None,
                 secret_file: str | None = None) -> None:
        self.port = port or free_port()
        secret = ["--bootstrap-secret-file", secret_file] if secret_file else []
        super().__init__(["serve", "--frontend-only", "--engine", engine_address,
                          "--port", str(self.port), *secret, *flags], name=name, env=env)
        self.base_url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> "FrontendProcess":
        self.wait_for_output(re.escape(FRONTEND_READY), timeout_s)
        return self


# -- metrics ----------------------------------------------------------------------------------

_METRIC_LINE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")


def read_metrics(base_url: str, client: httpx.Client | None = None) -> dict[str, float]:
    """``/metrics`` as {name: value}, summing over label sets."""
    get = client.get if client is not None else httpx.get
    r = get(f"{base_url}/metrics", timeout=10)
    r.raise_for_status()
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        m = _METRIC_LINE.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


_IDLE_GAUGES = ("blink:num_requests_running", "blink:num_requests_waiting",
                "blink:kv_cache_usage_perc")


def engine_idle(base_url: str) -> bool:
    """No request running or waiting, and no KV-cache block in use (cached-but-free prefix
    blocks count as free)."""
    m = read_metrics(base_url)
    return all(m[name] == 0 for name in _IDLE_GAUGES)


def wait_engine_idle(base_url: str, timeout_s: float = 30.0, what: str = "",
                     logs: Callable[[], str] | None = None) -> None:
    """Wait until :func:`engine_idle`; on timeout, fail showing the gauges (and ``logs()``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = read_metrics(base_url)
        if all(m[name] == 0 for name in _IDLE_GAUGES):
            return
        if time.monotonic() > deadline:
            gauges = {name: m[name] for name in _IDLE_GAUGES}
            extra = f"\n{logs()}" if logs is not None else ""
            raise AssertionError(f"the engine is not idle {timeout_s:g} s {what}: {gauges}{extra}")
        time.sleep(0.1)


def assert_error_shape(response: httpx.Response, status: int, *, type: str | None = None,
                       param: str | None = ..., code: str | None = ...) -> dict:  # type: ignore[assignment]
    """An OpenAI/vLLM-style error body with ``status``; returns the ``error`` object."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert body.get("object") == "error", body
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    if type is not None:
        assert err["type"] == type, err
    if param is not ...:
        assert err["param"] == param, err
    if code is not ...:
        assert err["code"] == code, err
    return err
