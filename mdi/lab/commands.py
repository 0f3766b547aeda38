"""Running this machine's own commands (ip, tc, git, uptime) for the lab: checked, or just
for their text."""
import os
import subprocess
from typing import List


class EmulationError(RuntimeError):
    """Emulation was required (mode 'on') but a part of it cannot be set up."""


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def run_checked(cmd: List[str], timeout: float = 10.0) -> None:
    """Run `cmd`; EmulationError (with its stderr) if it cannot run or fails."""
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EmulationError("%s: %s" % (" ".join(cmd), e))
    if r.returncode != 0:
        raise EmulationError("%s: %s" % (" ".join(cmd), r.stderr.decode(errors="replace").strip()))


def try_run(cmd: List[str]) -> List[str]:
    """Run `cmd` for a teardown: [] when it worked, else [what went wrong]."""
    try:
        run_checked(cmd)
        return []
    except EmulationError as e:
        return [str(e)]


def command_text(cmd: List[str]) -> str:
    """What `cmd` prints on stdout, stripped; "" when it cannot run."""
    try:
        return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              timeout=10).stdout.decode().strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""
