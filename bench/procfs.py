"""What /proc says about a process, for the benchmarks (bench/*/run.py import it): CPU time and
page faults (/proc/<pid>/stat: every thread, live or ended), resident memory and its peak
(/proc/<pid>/status, its peak reset through /proc/<pid>/clear_refs), proportional and private
memory (/proc/<pid>/smaps_rollup)."""
from __future__ import annotations

import os

CLK_TCK = os.sysconf("SC_CLK_TCK")  # /proc's CPU times tick at 1/CLK_TCK s (10 ms)


def _stat(pid: int) -> list:
    """/proc/<pid>/stat's fields after the command name (field 3 onward: state is [0])."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def cpu_ms(pid: int) -> float:
    """User + system CPU time so far, ms."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) * 1000.0 / CLK_TCK


def counters(pid: int) -> dict:
    """Minor page faults, CPU time (user + system) and its system part (ms) so far."""
    fields = _stat(pid)
    return {"minflt": int(fields[7]), "cpu_ms": (int(fields[11]) + int(fields[12])) * 1e3 / CLK_TCK,
            "sys_ms": int(fields[12]) * 1e3 / CLK_TCK}


def status_mib(pid: int) -> dict:
    """VmRSS (resident now) and VmHWM (its peak since the process began), MiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) / 1024.0
    return {"rss": out["VmRSS"], "hwm": out["VmHWM"]}


def reset_hwm(pid: int) -> None:
    """Resets VmHWM to the current VmRSS (clear_refs 5), so that the next status_mib's hwm is
    the peak from here on."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def rollup_mib(pid: int) -> dict:
    """Every kB field of /proc/<pid>/smaps_rollup (Rss, Pss, Pss_Anon, Pss_Shmem,
    Private_Clean, ...), MiB, under the file's own names."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) / 1024.0
    return out
