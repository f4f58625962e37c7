"""A stand-in device for the redzones' bookkeeping with no GPU: numpy arrays are device memory,
and the check reads every guard by its address, word by word, as `redzone_check.cu` does
(the same masks, the same nearest byte, the same atomicMin of check number and distance)."""

import ctypes

import numpy as np

from harness.library.redzones import NONE

MASK = (1 << 64) - 1


class StandInDevice:
    def __init__(self):
        self.capturing = False
        self.checks = 0
        self.syncs = 0
        self.waits = 0
        self.fault = None  # an exception every wait for the device raises from now on (a faulted context)

    def full(self, n, bits, uint):
        return np.full(int(n), bits, dtype=uint)

    def from_host(self, host):
        return host.copy()

    def fill(self, array, bits):
        array[...] = bits

    def address(self, array):
        return array.__array_interface__["data"][0]

    def keep(self, array):
        return None  # numpy frees an array's memory after its weak references are told

    def read(self, array):
        return array.copy()

    def read_bytes(self, address, nbytes):
        return ctypes.string_at(address, nbytes)

    def read_slots(self, results, start, count):
        return results[start:start + count].copy()

    def set_slots(self, results, start, values):
        results[start:start + len(values)] = values

    def current_stream(self):
        return "the current stream"

    def stream_key(self, stream):
        return stream

    def is_capturing(self, stream):
        return self.capturing

    def record(self, stream=None, event=None):
        return "an event"

    def wait(self, events):
        self.waits += len(events)

    def upload(self, records, stream, writes):
        return records.copy()

    def new_results(self, count):
        return np.full(count, NONE, np.uint64)

    def synchronize(self):
        if self.fault is not None:
            raise self.fault
        self.syncs += 1

    def launch_check(self, table, count, results, seq, blocks, stream, uploaded):
        self.checks += 1
        for guard in table[:count]:
            start, end, pattern, side, slot = (int(guard[k]) for k in ("start", "end", "pattern", "side", "slot"))
            first = start & ~7
            words = np.frombuffer(ctypes.string_at(first, end - first), dtype="<u8")
            for w, word in enumerate(words):
                at = first + 8 * w
                diff = int(word) ^ pattern
                if at < start:
                    diff &= (MASK << ((start - at) * 8)) & MASK
                if not diff:
                    continue
                if side == 0:
                    distance = end - (at + ((diff.bit_length() - 1) >> 3))
                else:
                    distance = at + (((diff & -diff).bit_length() - 1) >> 3) - start
                results[slot] = min(int(results[slot]), (seq << 32) | distance)


def plant(view, offset: int, data: bytes) -> None:
    """A stray store of `data` at `offset` bytes from the view's first byte (negative: before it)."""
    ctypes.memmove(view.__array_interface__["data"][0] + offset, data, len(data))
