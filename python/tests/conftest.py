"""A real `kvferry node` for the package's tests.

The binary is ``$KVFERRY_BIN``, else ``target/debug/kvferry`` under the repository root
(``cargo build -p kvferry``). Each node gets its own config file and fd directory in a
temporary folder, a host device (no GPU), an engine listener on a free loopback port and no
metrics listener.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, Optional

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[2]


def kvferry_bin() -> Path:
    path = Path(os.environ.get("KVFERRY_BIN", ROOT / "target" / "debug" / "kvferry"))
    if not path.exists():
        pytest.fail(f"no kvferry binary at {path}: run `cargo build -p kvferry` or set KVFERRY_BIN")
    return path


class NodeProc:
    """``kvferry node --config FILE`` as a child process; ``addr`` is its engine service.
    ``device``: the node's ``[device] kind`` ("host": emulated, "cuda": the GPU);
    ``extra``: TOML appended to the config; ``listen``: the engine address (default a free
    loopback port)."""

    def __init__(self, tmp: Path, name: str = "py-node", token: str = "", extra: str = "",
                 device: str = "host", listen: str = "127.0.0.1:0"):
        self.dir = tmp
        fd_dir = tmp / "fd"
        fd_dir.mkdir(parents=True, exist_ok=True)
        config = tmp / f"{name}.toml"
        config.write_text(
            f'node-id = "{name}"\n'
            '[pool]\nsize = "64MiB"\nslot-bytes = "256KiB"\n'
            f'[device]\nkind = "{device}"\n'
            '[metrics]\nlisten = ""\n'
            f'[engine]\nlisten = "{listen}"\nfd-dir = "{fd_dir}"\ntoken = "{token}"\n'
            + extra
        )
        self.proc = subprocess.Popen(
            [str(kvferry_bin()), "node", "--config", str(config)],
            stdout=subprocess.PIPE,
            text=True,
        )
        lines: "queue.Queue[Optional[str]]" = queue.Queue()

        def pump():
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                lines.put(line.strip())
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        seen: Dict[str, str] = {}
        end = time.monotonic() + 60
        while not {"engine", "engine-fd"} <= seen.keys():
            try:
                line = lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                self.stop()
                raise RuntimeError(f"node {name} did not start serving (saw {seen})")
            if line.startswith("listening ") and "=" in line:
                what, addr = line[len("listening "):].split("=", 1)
                seen[what] = addr
        self.addr = seen["engine"]
        self.fd_socket = seen["engine-fd"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="session")
def node(tmp_path_factory):
    n = NodeProc(tmp_path_factory.mktemp("node"))
    yield n
    n.stop()


@pytest.fixture
def client(node):
    import kvferry

    return kvferry.EngineClient(node.addr, deadline_s=10.0)


@pytest.fixture
def fresh_node(tmp_path):
    """A node of the test's own, for tests that stop it."""
    n = NodeProc(tmp_path)
    yield n
    n.stop()
