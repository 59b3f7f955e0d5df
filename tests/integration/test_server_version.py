"""Services refuse a nats-server older than the design needs (2.12: atomic batches) with one
line naming both versions. The old server is a stand-in that speaks just enough of the NATS
protocol (INFO, then PONG to PING) to announce its version, as nats-server 2.11 would."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from gpusched.bus.servers import free_port


async def _old_server(port: int, version: str) -> asyncio.AbstractServer:
    info = {"server_id": "OLD", "version": version, "proto": 1, "max_payload": 1048576, "headers": True,
            "jetstream": True, "host": "127.0.0.1", "port": port}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(f"INFO {json.dumps(info)}\r\n".encode())
        await writer.drain()
        try:
            while line := await reader.readline():
                if line.startswith(b"PING"):
                    writer.write(b"PONG\r\n")
                    await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", port)


async def test_a_service_refuses_nats_server_2_11_with_one_line():
    port = free_port()
    server = await _old_server(port, "2.11.4")
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gpusched.cli.main", "service", "run", "admission", "--nats",
            f"nats://127.0.0.1:{port}", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        server.close()
    assert proc.returncode == 2, err.decode()[-2000:]
    lines = [line for line in err.decode().splitlines() if "nats-server" in line]
    assert lines == ["gpusched admission: nats-server 2.11.4 is too old: gpusched needs >= 2.12.0 "
                     "(atomic batches); upgrade the server"], err.decode()[-2000:]
    assert "Traceback" not in err.decode()
