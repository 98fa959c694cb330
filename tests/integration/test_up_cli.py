"""`remp up` fails fast and cleanly (no engine): a busy port is named, nothing is started."""

import socket
import subprocess
import sys

import psutil


def test_busy_port_fails_at_once_and_starts_nothing(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        p = subprocess.Popen([sys.executable, "-m", "remp.cli", "up", "--free-ports",
                              "--controller-port", str(port), "--log-dir", str(tmp_path),
                              "--model", str(tmp_path / "model")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = p.communicate(timeout=60)
    assert p.returncode == 1, out
    assert f"controller {port}" in out and "ports in use" in out
    assert not (tmp_path / "model").exists()
    assert not [c for c in psutil.Process().children(recursive=True) if "redis" in c.name()]
