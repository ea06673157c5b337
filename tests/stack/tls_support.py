"""A TLS front for the Temporal dev server: nginx with `grpc_pass`, certificates from a test CA.

The dev server speaks plain gRPC; production servers (Temporal Cloud, a cluster behind an
ingress) want TLS and, often, a client certificate. Debian's nginx terminates TLS on a free
loopback port, requires a client certificate signed by the test CA (`ssl_verify_client on`) and
passes the gRPC calls on to the dev server. Every file it uses is written to a directory of the
caller's (its config, pid file, logs, temp folders); it runs in the foreground (`daemon off`) as
our child and is stopped by its PID.

`TlsFiles` are the CA, the server's certificate (for `localhost` and 127.0.0.1) and a client
certificate, as PEM files; `client_profile` writes a Temporal environment-configuration TOML
profile that uses them, as a user would configure the worker and the CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trustme
from cryptography import x509

from devstack.free_ports import free_port

NGINX_CANDIDATES = ("/usr/sbin/nginx",)
SERVER_NAME = "localhost"
# Long polls last about a minute; nginx's default read timeout is 60 s.
GRPC_TIMEOUT_S = 300


def nginx_binary() -> str | None:
    """Debian's nginx (with the gRPC proxy and HTTP/2 modules), or one on PATH."""
    for candidate in NGINX_CANDIDATES:
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("nginx")


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path
    server_cert: Path  # the chain nginx presents
    server_key: Path
    client_cert: Path
    client_key: Path

    def client_subject(self) -> str:
        """The client certificate's subject as nginx logs it ($ssl_client_s_dn, RFC 4514)."""
        cert = x509.load_pem_x509_certificate(self.client_cert.read_bytes())
        return cert.subject.rfc4514_string()

    @classmethod
    def issue(cls, directory: Path) -> TlsFiles:
        """A fresh test CA, a server certificate and a client certificate, as PEM files."""
        directory.mkdir(parents=True, exist_ok=True)
        ca = trustme.CA()
        server = ca.issue_cert(SERVER_NAME, "127.0.0.1")
        client = ca.issue_cert("durable-comfy-test-client")
        files = cls(
            ca_cert=directory / "ca.pem",
            server_cert=directory / "server.pem",
            server_key=directory / "server.key",
            client_cert=directory / "client.pem",
            client_key=directory / "client.key",
        )
        ca.cert_pem.write_to_path(str(files.ca_cert))
        server.private_key_pem.write_to_path(str(files.server_key))
        client.private_key_pem.write_to_path(str(files.client_key))
        for blob in server.cert_chain_pems:
            blob.write_to_path(str(files.server_cert), append=True)
        client.cert_chain_pems[0].write_to_path(str(files.client_cert))
        return files


def client_profile(
    path: Path,
    profile: str,
    *,
    address: str,
    namespace: str,
    tls: TlsFiles,
    with_client_cert: bool = True,
) -> Path:
    """Append a `[profile.<profile>]` with TLS to a Temporal env-config TOML file."""
    lines = [
        f"[profile.{profile}]",
        # A JSON string is a valid TOML basic string.
        f"address = {json.dumps(address)}",
        f"namespace = {json.dumps(namespace)}",
        "",
        f"[profile.{profile}.tls]",
        f"server_name = {json.dumps(SERVER_NAME)}",
        f"server_ca_cert_path = {json.dumps(str(tls.ca_cert))}",
    ]
    if with_client_cert:
        lines += [
            f"client_cert_path = {json.dumps(str(tls.client_cert))}",
            f"client_key_path = {json.dumps(str(tls.client_key))}",
        ]
    with path.open("a") as out:
        out.write("\n".join([*lines, "", ""]))
    return path


@dataclass
class NginxFront:
    address: str  # host:port clients connect to
    process: asyncio.subprocess.Process
    directory: Path

    @property
    def access_log(self) -> Path:
        return self.directory / "access.log"

    @property
    def error_log(self) -> Path:
        return self.directory / "error.log"

    def group_alive(self) -> bool:
        """Whether any process of nginx's own session (master, workers) is still there."""
        try:
            os.killpg(self.process.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def grpc_calls(self) -> list[dict[str, str]]:
        """Every call nginx passed on (or refused): method path, HTTP status, client subject."""
        try:
            text = self.access_log.read_text()
        except OSError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def nginx_conf(directory: Path, port: int, upstream: str, tls: TlsFiles) -> str:
    temp = directory / "temp"
    user = "user root;" if os.geteuid() == 0 else ""  # else nginx drops to `nobody`
    return f"""
{user}
worker_processes 1;
pid {directory / "nginx.pid"};
error_log {directory / "error.log"} info;
events {{ worker_connections 512; }}
http {{
    client_body_temp_path {temp / "body"};
    proxy_temp_path {temp / "proxy"};
    fastcgi_temp_path {temp / "fastcgi"};
    uwsgi_temp_path {temp / "uwsgi"};
    scgi_temp_path {temp / "scgi"};
    log_format calls escape=json
        '{{"uri":"$uri","status":"$status","grpc_status":"$upstream_http_grpc_status",'
        '"verify":"$ssl_client_verify","client":"$ssl_client_s_dn"}}';
    access_log {directory / "access.log"} calls;
    client_max_body_size 0;
    server {{
        listen 127.0.0.1:{port} ssl http2;
        ssl_certificate {tls.server_cert};
        ssl_certificate_key {tls.server_key};
        ssl_client_certificate {tls.ca_cert};
        ssl_verify_client on;
        location / {{
            grpc_pass grpc://{upstream};
            grpc_read_timeout {GRPC_TIMEOUT_S}s;
            grpc_send_timeout {GRPC_TIMEOUT_S}s;
        }}
    }}
}}
"""


def write_conf(directory: Path, port: int, upstream: str, tls: TlsFiles) -> Path:
    (directory / "temp").mkdir(parents=True, exist_ok=True)
    conf = directory / "nginx.conf"
    conf.write_text(nginx_conf(directory, port, upstream, tls))
    return conf


def _accepts(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@asynccontextmanager
async def nginx_front(
    nginx: str, directory: Path, upstream: str, tls: TlsFiles
) -> AsyncIterator[NginxFront]:
    """nginx on a free loopback port in front of `upstream` (host:port), stopped by its PID."""
    port = free_port()
    conf = write_conf(directory, port, upstream, tls)
    argv = [nginx, "-p", str(directory), "-c", str(conf), "-e", str(directory / "error.log")]
    test = await asyncio.create_subprocess_exec(
        *argv, "-t", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await test.communicate()
    if test.returncode != 0:
        raise RuntimeError(f"nginx refused its config:\n{out.decode()}")
    process = await asyncio.create_subprocess_exec(
        *argv,
        "-g",
        "daemon off;",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True,
    )
    front = NginxFront(f"127.0.0.1:{port}", process, directory)
    try:
        deadline = time.monotonic() + 15
        while not _accepts(port):
            if process.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not start:\n{_tail(front.error_log)}")
            await asyncio.sleep(0.05)
        yield front
    finally:
        await _stop(process)


async def _stop(process: asyncio.subprocess.Process) -> None:
    """SIGTERM (nginx's fast shutdown: long polls need not end first) to the master by its
    PID; SIGKILL to its process group (master and workers) if it lingers."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), timeout=10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # its own session: master and workers
            await asyncio.wait_for(process.wait(), timeout=5)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text().splitlines()[-lines:])
    except OSError:
        return "(no error log)"
