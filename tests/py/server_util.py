"""Starting and stopping a real `serval serve` for black-box tests."""
import json
import os
import signal
import ssl
import socket
import subprocess
import time
import urllib.error
import urllib.request

from conftest import SERVAL


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model, *args, name=None, cafile=None, kv_memory="256MiB", port=None, env=None):
        """`cafile`: the server speaks HTTPS with a certificate that this CA file trusts; `port`: this one
        (a restarted server at its old address) instead of a free one; `env`: added to the environment."""
        self.port = port or free_port()
        self.url = f"{'https' if cafile else 'http'}://127.0.0.1:{self.port}"
        self.ssl = ssl.create_default_context(cafile=str(cafile)) if cafile else None
        cmd = [str(SERVAL), "serve", str(model), "--port", str(self.port), "--kv-cache-memory", kv_memory, *map(str, args)]
        if name:
            cmd += ["--served-model-name", name]
        self.log = open(os.devnull, "w") if os.environ.get("SERVAL_QUIET") else None
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        self.wait_ready()

    def wait_ready(self, timeout=120):
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, f"server exited: {self.proc.stdout.read()}"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2, context=self.ssl) as r:
                    if json.load(r)["status"] == "ok":
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise TimeoutError("server did not become ready")

    def get(self, path, headers=None):
        req = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=60, context=self.ssl) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, path, body, headers=None, raw=False):
        data = body if raw else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=300, context=self.ssl) as r:
                return r.status, json.loads(r.read()), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}"), dict(e.headers)

    def named_events(self, path, body, headers=None):
        """A streaming POST's named SSE events (Anthropic's and OpenAI Responses' `event:` + `data:`) as
        (name, data) pairs, read with urllib (the clients hide the names)."""
        req = urllib.request.Request(self.url + path, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
        with urllib.request.urlopen(req, timeout=120, context=self.ssl) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            blocks = r.read().decode().strip().split("\n\n")
        events = []
        for block in blocks:
            lines = dict(line.split(": ", 1) for line in block.split("\n"))
            events.append((lines["event"], json.loads(lines["data"])))
        return events

    def open_stream(self, path, body):
        """Sends a streaming POST on a raw socket (so a test can drop the connection); returns the socket."""
        sock = socket.create_connection(("127.0.0.1", self.port))
        data = json.dumps(body)
        sock.sendall((f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(data)}\r\n\r\n{data}").encode())
        return sock

    def metric(self, name):
        _, text = self.get("/metrics")
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self, sig=signal.SIGTERM, timeout=60):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                raise
        return self.proc.returncode
