// The redzone check (harness.library.redzones): every registered guard region compared with its
// pattern, on the device. For each guard that differs, the changed byte nearest its buffer's view
// is kept per result slot by atomicMin of (check sequence number << 32 | distance from the view):
// the earliest check that saw a write, and within it the write nearest the buffer. Only the result
// array is ever copied to the host.

struct Guard {
    unsigned long long start;    // the guard's first byte (an address)
    unsigned long long end;      // one past its last byte; a multiple of 8 (the allocation is)
    unsigned long long pattern;  // the pattern's bytes as memory holds them at an 8-aligned address
    unsigned int side;           // 0: before the view (it ends where the view starts), 1: after it
    unsigned int slot;           // where its result goes
};

extern "C" __global__ void harness_redzone_check(const Guard* guards, unsigned int count,
                                                 unsigned long long* results, unsigned int seq) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned int g = blockIdx.y; g < count; g += gridDim.y) {
        const Guard guard = guards[g];
        const unsigned long long first = guard.start & ~7ull;  // the word holding the guard's first byte
        const unsigned long long words = (guard.end - first) >> 3;
        for (unsigned long long w = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; w < words;
             w += stride) {
            const unsigned long long at = first + (w << 3);
            unsigned long long diff = *reinterpret_cast<const unsigned long long*>(at) ^ guard.pattern;
            if (at < guard.start) {  // the bytes of the word before the guard are the view's own
                diff &= ~0ull << ((guard.start - at) * 8);
            }
            if (diff == 0) {
                continue;
            }
            unsigned long long distance;
            if (guard.side == 0) {  // bytes before the view: the highest changed byte is nearest it
                distance = guard.end - (at + ((63 - __clzll((long long)diff)) >> 3));
            } else {  // bytes after the view: the lowest changed byte is nearest it
                distance = at + ((__ffsll((long long)diff) - 1) >> 3) - guard.start;
            }
            atomicMin(results + guard.slot, ((unsigned long long)seq << 32) | distance);
        }
    }
}
