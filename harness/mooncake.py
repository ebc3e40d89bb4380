"""Mooncake Store's master as a subprocess on loopback, on free ports, with its log (tests and benchmarks of
`layertap.stream`)."""

from __future__ import annotations

import os
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from harness.processes import Proc, ProcessExited, wait_for
from layertap.engines.sglang import free_port

# The wheel's own entry point (`mooncake_master`), from this interpreter's environment.
MASTER = (sys.executable, "-m", "mooncake.cli")


@dataclass
class MooncakeMaster:
    """A ``mooncake_master`` of our own on 127.0.0.1 (its RPC and metrics ports free ones); ``restart`` keeps them."""

    dir: Path
    port: int
    metrics_port: int
    proc: Proc | None = None

    @classmethod
    def ephemeral(cls, folder: Path) -> MooncakeMaster:
        """One on free ports, started."""
        port, metrics = free_port(), free_port()
        while metrics == port:  # both free when drawn, neither bound yet: a draw can repeat (a master exited so once)
            metrics = free_port()
        return cls(folder, port, metrics).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        """Its own Prometheus text: ``master_key_count``, ``segment_allocated_bytes{segment}`` (bytes its objects
        take in each client's segment)..."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self) -> MooncakeMaster:
        cmd = [*MASTER, f"-rpc_port={self.port}", "-rpc_address=127.0.0.1", f"-metrics_port={self.metrics_port}",
               "-metrics_host=127.0.0.1"]  # fmt: skip
        self.proc = Proc(f"mooncake_master:{self.port}", cmd, dict(os.environ), self.dir / "mooncake_master.log")
        self.proc.start()

        def serving() -> bool:
            if not self.proc.alive():
                raise ProcessExited(f"mooncake_master exited\n{self.proc.log_tail()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            except OSError:
                return False
            return True

        wait_for(serving, timeout=30, what=f"mooncake_master on port {self.port}", every=0.1)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            self.proc.kill(sig)

    def restart(self) -> None:
        """Killed and started again on the same port: every object it knew of is forgotten."""
        self.stop(signal.SIGKILL)
        self.start()
