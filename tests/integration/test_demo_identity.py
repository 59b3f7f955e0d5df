"""`gpusched demo` connects to its own temporary stack as that stack's admin, whatever client
config or $GPUSCHED_CREDS names (after one `make up`, both name another stack's identity)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

from gpusched.bus.control_client import Client
from gpusched.bus.log import EventLog
from gpusched.cli import demo
from gpusched.cli.stack import Stack


def _demo_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["demo", *argv])


def test_the_scene_connects_with_its_own_stacks_credentials(tmp_path, monkeypatch, trust):
    other = tmp_path / "config.toml"  # the client config `gpusched up` wrote for another stack
    other.write_text(f'nats = "nats://127.0.0.1:1"\ncreds = "{trust.creds("admin")}"\n')
    monkeypatch.setenv("GPUSCHED_CONFIG", str(other))
    monkeypatch.delenv("GPUSCHED_CREDS")
    args = _demo_args(["--quick", "--data-dir", str(tmp_path / "demo")])
    data_dir = (tmp_path / "demo").resolve()
    data_dir.mkdir()
    stack = Stack(demo._stack_args(args, data_dir), data_dir)
    try:
        stack.start_nats()
        url, creds = demo.scene_identity(stack)
        assert url == stack.nats_url and creds is not None and creds.startswith(str(data_dir))

        async def both() -> tuple[int, str]:
            async with await Client.connect(url, creds=creds) as client:
                log = await EventLog.open(url, name="test-demo", creds=creds)
                try:
                    return await log.last_seq(), client.nc.connected_url.netloc
                finally:
                    await log.close()

        assert asyncio.run(both())[0] >= 0

        async def as_the_config_says() -> None:
            await Client.connect(url, timeout=2.0)

        with pytest.raises(Exception, match="(?i)authoriz|credential|refused"):  # what the scene once did
            asyncio.run(as_the_config_says())
    finally:
        stack.stop()


def test_the_readmes_keys_path_is_where_up_writes_the_keys(tmp_path, monkeypatch):
    """README: `gpusched replay --verify --keys DATA_DIR/trust/keys.json`; without --keys,
    $GPUSCHED_DATA_DIR finds the same file."""
    from gpusched.cli.replay import default_keys_path

    data_dir = tmp_path.resolve()
    stack = Stack(demo._stack_args(_demo_args(["--quick"]), data_dir), data_dir)
    stack.start_trust()
    assert (data_dir / "trust" / "keys.json").is_file()
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert "replay --verify --keys DATA_DIR/trust/keys.json" in readme
    monkeypatch.delenv("GPUSCHED_KEYS")
    monkeypatch.setenv("GPUSCHED_CONFIG", str(tmp_path / "no-client-config.toml"))  # not another stack's
    monkeypatch.setenv("GPUSCHED_DATA_DIR", str(data_dir))
    assert default_keys_path() == data_dir / "trust" / "keys.json"
