"""A real ``kvferry node`` for the Python tests: one class for the package's tests and the
vLLM connector's.

The binary is ``$KVFERRY_BIN``, else ``target/debug/kvferry`` (or ``target/release``) under
the repository root. Each node gets its own config file and fd directory, a host device
unless told (``device="cuda"`` on a GPU machine), an engine listener on a loopback port
chosen up front (so :meth:`Node.start` after :meth:`Node.kill` restarts it on the same
address) and a metrics listener on a loopback port the node picks (:meth:`Node.metrics`).
"""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Dict, Optional

ROOT = Path(__file__).resolve().parents[2]


def kvferry_bin() -> Path:
    env = os.environ.get("KVFERRY_BIN")
    if env:
        return Path(env)
    for profile in ("debug", "release"):
        p = ROOT / "target" / profile / "kvferry"
        if p.exists():
            return p
    raise FileNotFoundError("no kvferry binary: run `cargo build -p kvferry` or set KVFERRY_BIN")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """``kvferry node --config FILE`` as a child process; ``addr`` is its engine service.

    ``device``: the node's ``[device] kind``; ``token``: its engine token; ``extra``: TOML
    appended to the config; ``listen`` / ``port``: the engine address (default a free
    loopback port); ``pool`` / ``slot``: the host pool's size and slot size."""

    def __init__(self, tmp: Path, name: str = "py-node", *, token: str = "", extra: str = "",
                 device: str = "host", listen: Optional[str] = None, port: Optional[int] = None,
                 pool: str = "64MiB", slot: str = "256KiB"):
        self.dir = Path(tmp)
        self.name = name
        self.device = device
        self.token, self.extra = token, extra
        self.pool, self.slot = pool, slot
        self.addr = listen or f"127.0.0.1:{port or free_port()}"
        self.fd_socket = ""
        self.proc: Optional[subprocess.Popen] = None
        self.start()

    def start(self) -> None:
        fd_dir = self.dir / f"{self.name}-fd"
        fd_dir.mkdir(parents=True, exist_ok=True)
        config = self.dir / f"{self.name}.toml"
        config.write_text(
            f'node-id = "{self.name}"\n'
            f'[pool]\nsize = "{self.pool}"\nslot-bytes = "{self.slot}"\n'
            f'[device]\nkind = "{self.device}"\n'
            '[metrics]\nlisten = "127.0.0.1:0"\n'
            f'[engine]\nlisten = "{self.addr}"\nfd-dir = "{fd_dir}"\ntoken = "{self.token}"\n'
            + self.extra
        )
        self.proc = proc = subprocess.Popen(
            [str(kvferry_bin()), "node", "--config", str(config)],
            stdout=subprocess.PIPE,
            text=True,
        )
        lines: "queue.Queue[Optional[str]]" = queue.Queue()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line.strip())
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        seen: Dict[str, str] = {}
        end = time.monotonic() + 60
        while not {"engine", "engine-fd", "metrics"} <= seen.keys():
            try:
                line = lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                self.kill()
                raise RuntimeError(f"node {self.name} did not start serving (saw {seen})")
            if line.startswith("listening ") and "=" in line:
                what, addr = line[len("listening "):].split("=", 1)
                seen[what] = addr
        # Every "listening WHAT=ADDR" line (the event sockets too, where configured).
        self.listening = seen
        self.addr = seen["engine"]
        self.fd_socket = seen["engine-fd"]
        self.metrics_addr = seen["metrics"]

    def metrics(self) -> str:
        """The node's Prometheus scrape."""
        import urllib.request

        with urllib.request.urlopen(f"http://{self.metrics_addr}/metrics", timeout=10) as r:
            return r.read().decode()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    stop = kill

    def stop_signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def pause(self) -> None:
        """SIGSTOP, returning once every thread of the node is stopped: the signal lands a
        moment after kill() returns (later on a loaded machine), and a request sent in between
        would still be served."""
        assert self.proc is not None
        import signal

        self.stop_signal(signal.SIGSTOP)
        task = Path(f"/proc/{self.proc.pid}/task")
        end = time.monotonic() + 10
        while time.monotonic() < end:
            states = []
            for t in task.iterdir():
                try:
                    states.append((t / "stat").read_text().rsplit(")", 1)[1].split()[0])
                except OSError:
                    pass
            if states and all(st in "Tt" for st in states):
                return
            time.sleep(0.001)
        raise AssertionError(f"node {self.name} did not stop")


def cluster_node(tmp: Path, name: str, peer_ports: Dict[str, int], **kw) -> Node:
    """Node ``name`` of a cluster over TCP (static peers) on loopback: ``peer_ports`` maps
    every node's name to its peer port."""
    me = peer_ports[name]
    extra = (
        f'[cluster]\nprovider = "tcp"\npeer-listen = "127.0.0.1:{me}"\n'
        f'data-listen = "127.0.0.1:0"\nshm-dir = "{tmp}"\ntoken = "cluster-secret"\n'
        'directory = "static"\n'
    )
    for peer, port in peer_ports.items():
        if peer != name:
            extra += f'[[cluster.peers]]\nnode-id = "{peer}"\naddress = "127.0.0.1:{port}"\n'
    return Node(tmp, name=name, extra=extra, **kw)
