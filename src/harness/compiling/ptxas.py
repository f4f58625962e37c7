"""ptxas' per-kernel report (`-v`, which both backends pass), read from the compiler's log:
registers, spill bytes, shared and stack bytes of each entry function."""

from __future__ import annotations

import re
from dataclasses import dataclass

ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


@dataclass(frozen=True)
class KernelResources:
    """ptxas' report for one entry function."""

    kernel: str  # the name expression when one maps to it, else the symbol
    symbol: str
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int
    stack_bytes: int

    @property
    def spill_bytes(self) -> int:
        return self.spill_stores + self.spill_loads


def parse_resources(log: str, symbol_mapping: dict) -> tuple[KernelResources, ...]:
    by_symbol = {sym: expr for expr, sym in symbol_mapping.items()}
    out: list[KernelResources] = []
    current: dict | None = None

    def flush():
        if current and "registers" in current:
            sym = current["symbol"]
            out.append(
                KernelResources(
                    kernel=by_symbol.get(sym, sym),
                    symbol=sym,
                    registers=current["registers"],
                    spill_stores=current.get("spill_stores", 0),
                    spill_loads=current.get("spill_loads", 0),
                    shared_bytes=current.get("smem", 0),
                    stack_bytes=current.get("stack", 0),
                )
            )

    for line in log.splitlines():
        if m := ENTRY.search(line):
            flush()
            current = {"symbol": m.group(1)}
        elif current is not None and (m := _FRAME.search(line)):
            current["stack"], current["spill_stores"], current["spill_loads"] = map(int, m.groups())
        elif current is not None and (m := _USED.search(line)):
            current["registers"] = int(m.group(1))
            current["smem"] = int(m.group(2) or 0)
    flush()
    return tuple(out)
