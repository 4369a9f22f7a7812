"""`join` lets torch's idle OpenMP threads sleep instead of spinning, unless the user
chose a wait policy; and sets it before torch is imported (libgomp reads it at load)."""

from __future__ import annotations

import subprocess
import sys

from p2pswarm.cli.swarm import idle_threads_sleep


def test_idle_threads_sleep_unless_the_user_chose() -> None:
    environ: dict[str, str] = {"OMP_NUM_THREADS": "2"}
    idle_threads_sleep(environ)
    assert environ == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"},
                   {"KMP_BLOCKTIME": "200"}):
        environ = dict(chosen)
        idle_threads_sleep(environ)
        assert environ == chosen  # the user's word stands


def test_the_join_command_imports_no_torch_before_it_sets_the_policy() -> None:
    # everything `join` imports before it calls idle_threads_sleep
    code = ("import sys, p2pswarm.cli.app, p2pswarm.cli.swarm, p2pswarm.agent.node, "
            "p2pswarm.cli.http_options, p2pswarm.home, p2pswarm.inventory, "
            "p2pswarm.security; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"
