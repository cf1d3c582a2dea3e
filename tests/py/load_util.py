"""A small HTTP/1.1 client on raw asyncio streams for load tests: many concurrent connections, SSE
parsing, and clients that hang up at chosen points (mid-stream, before the answer, mid-request).
Standard library only, so tests/soak/soak.py runs as a plain script."""
import asyncio
import json
import re
import resource
import time

_STATUS = re.compile(rb"HTTP/1\.[01] (\d{3})")


def raise_fd_limit(want):
    """Raises the soft open-files limit to `want` (up to the hard limit); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = new
    return soft


class HttpError(Exception):
    """The connection broke, or the server sent something that is not HTTP."""


class Conn:
    """One client connection (keep-alive capable)."""

    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, host, port, timeout=30):
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=1 << 20), timeout)
        return cls(reader, writer)

    def close(self):
        """Hangs up (the server sees EOF / a reset)."""
        try:
            self.writer.transport.abort()
        except Exception:
            pass

    def request_bytes(self, method, path, body=None, headers=None):
        data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        for k, v in (headers or {}).items():
            head += f"{k}: {v}\r\n"
        return head.encode() + b"\r\n" + data

    async def send(self, raw):
        self.writer.write(raw)
        await self.writer.drain()

    async def read_head(self):
        """Status and headers (lower-case names); raises HttpError if the connection ends first."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise HttpError(f"connection closed before the response head: {e!r}") from None
        m = _STATUS.match(head)
        if not m:
            raise HttpError(f"not an HTTP response: {head[:80]!r}")
        headers = {}
        for line in head.split(b"\r\n")[1:]:
            if b":" in line:
                k, v = line.split(b":", 1)
                headers[k.strip().lower().decode()] = v.strip().decode(errors="replace")
        return int(m.group(1)), headers

    async def body_chunks(self, headers):
        """Yields the body's bytes as they arrive (chunked, Content-Length, or until EOF)."""
        try:
            if headers.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    size_line = await self.reader.readuntil(b"\r\n")
                    size = int(size_line.split(b";")[0].strip(), 16)
                    if size == 0:
                        await self.reader.readuntil(b"\r\n")  # no trailers expected
                        return
                    data = await self.reader.readexactly(size + 2)
                    yield data[:-2]
            elif "content-length" in headers:
                n = int(headers["content-length"])
                if n:
                    yield await self.reader.readexactly(n)
            else:
                while True:
                    data = await self.reader.read(65536)
                    if not data:
                        return
                    yield data
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise HttpError(f"connection closed mid-body: {e!r}") from None

    async def read_body(self, headers):
        out = b""
        async for chunk in self.body_chunks(headers):
            out += chunk
        return out


class SseParser:
    """Splits an event stream into its `data:` payloads (comments such as `: ping` are skipped)."""

    def __init__(self):
        self.buf = b""

    def feed(self, data):
        self.buf += data
        out = []
        while True:
            cut = min((i for i in (self.buf.find(b"\n\n"), self.buf.find(b"\r\n\r\n")) if i >= 0), default=-1)
            if cut < 0:
                return out
            sep = 4 if self.buf[cut:cut + 4] == b"\r\n\r\n" else 2
            event, self.buf = self.buf[:cut], self.buf[cut + sep:]
            lines = [l[5:].lstrip(b" ") for l in event.replace(b"\r\n", b"\n").split(b"\n") if l.startswith(b"data:")]
            if lines:
                out.append(b"\n".join(lines).decode(errors="replace"))


def merge_chunks(events):
    """Texts per choice index, finish reasons, whether [DONE] came, and the usage chunk if any."""
    texts, finish, usage, done = {}, {}, None, False
    for e in events:
        if e == "[DONE]":
            done = True
            continue
        j = json.loads(e)
        if j.get("usage"):
            usage = j["usage"]
        for c in j["choices"]:
            i = c["index"]
            texts[i] = texts.get(i, "") + (c.get("text") or (c.get("delta") or {}).get("content") or "")
            if c.get("finish_reason"):
                finish[i] = c["finish_reason"]
    return texts, finish, usage, done


async def post_json(host, port, path, body, timeout=120):
    """One non-streaming request on its own connection: (status, headers, parsed JSON or raw text)."""
    conn = await Conn.open(host, port, timeout)
    try:
        await conn.send(conn.request_bytes("POST", path, body, {"Connection": "close"}))
        status, headers = await asyncio.wait_for(conn.read_head(), timeout)
        raw = await asyncio.wait_for(conn.read_body(headers), timeout)
        try:
            return status, headers, json.loads(raw)
        except ValueError:
            return status, headers, raw.decode(errors="replace")
    finally:
        conn.close()


async def get(host, port, path, timeout=10):
    """GET on its own connection: (status, body text, seconds taken)."""
    t0 = time.monotonic()
    conn = await Conn.open(host, port, timeout)
    try:
        await conn.send(conn.request_bytes("GET", path, None, {"Connection": "close"}))
        status, headers = await asyncio.wait_for(conn.read_head(), timeout)
        raw = await asyncio.wait_for(conn.read_body(headers), timeout)
        return status, raw.decode(errors="replace"), time.monotonic() - t0
    finally:
        conn.close()


def metric(text, name):
    """Sum of a Prometheus metric's samples (all label sets) in the exposition `text`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def blocks_held(state):
    """KV blocks held by requests in an /engine/state answer: 'u' (one holder) and 's' (shared)."""
    return sum(1 for ch in state["blocks"] if ch in "us")


def percentile(values, p):
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]
