"""What ``/proc`` says of a process (Linux): the tests and the soak driver wait on ranks, spares and
supervisors by pid, and a zombie waiting for its reaper counts as gone."""

from __future__ import annotations

from pathlib import Path


def process_state(pid: int) -> str | None:
    """The state letter of a process (``T``: stopped, ``S``: sleeping...), None once it is gone or a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return None
    return None if state == "Z" else state


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs and is not a zombie."""
    return process_state(pid) is not None
