"""What a benchmark reads off a pytest run and the machine it ran on: pytest's own "in N s"
(`SUMMARY`) and the GPUs' name (`device_name`). Shared by `bench gates` and `bench compare`."""

from __future__ import annotations

import re
import subprocess

SUMMARY = re.compile(r"\b\d+ (?:passed|failed)\b.* in ([0-9.]+)s")


def device_name() -> str:
    """`N x <name>` of the GPUs nvidia-smi lists, or `no GPU`."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()
        return f"{len(out)} x {out[0]}" if out else "no GPU"
    except (OSError, subprocess.SubprocessError):
        return "no GPU"
