"""What a trap, a CUDA context and cuInit cost on this GPU, alone and several at once.

`python3 docs/observed/trap-cost-h200.py` on the device (CuPy and cuda-python present): each
scenario starts N fresh processes that import CuPy, call cuInit, make the context, load a
module, then all launch at one wall-clock instant a kernel whose thread (0, 0) executes
`__trap()` (or a kernel that does not), and time the launch-and-synchronize until the error
comes back, and the process's exit. The record is trap-cost-h200.md beside this file."""
import json, os, sys, time, subprocess

SRC = r'''
extern "C" __global__ void trap_one(int *p, int n) {
    if (blockIdx.x == 0 && threadIdx.x == 0) __trap();
    if (threadIdx.x + blockIdx.x * blockDim.x < n) p[threadIdx.x + blockIdx.x * blockDim.x] = 1;
}
extern "C" __global__ void ok(int *p, int n) {
    int i = threadIdx.x + blockIdx.x * blockDim.x; if (i < n) p[i] = i;
}
'''

def child(argv):
    kind, reserve, grid, start_at = argv[0], int(argv[1]), int(argv[2]), float(argv[3])
    r = {"pid": os.getpid()}
    t = time.monotonic()
    import cupy
    from cuda.bindings import driver
    r["import"] = time.monotonic() - t; t = time.monotonic()
    driver.cuInit(0)
    r["cuinit"] = time.monotonic() - t; t = time.monotonic()
    cupy.cuda.runtime.free(0)
    r["context"] = time.monotonic() - t; t = time.monotonic()
    if reserve:
        cupy.empty(reserve << 20, dtype=cupy.uint8)
    buf = cupy.zeros(1 << 20, dtype=cupy.int32)
    mod = cupy.RawModule(code=SRC)
    mod.get_function("ok")((1,), (32,), (buf, cupy.int32(1)))  # warm: module loaded, launch path hot
    cupy.cuda.runtime.deviceSynchronize()
    r["setup"] = time.monotonic() - t
    while time.time() < start_at:
        time.sleep(0.001)
    t = time.monotonic()
    try:
        g = mod.get_function(kind)
        g((grid,), (256,), (buf, cupy.int32(grid * 256)))
        cupy.cuda.runtime.deviceSynchronize()
        r["error"] = None
    except Exception as e:
        r["error"] = type(e).__name__ + ": " + str(e)[:80]
    r["fault"] = time.monotonic() - t
    r["t_end"] = time.time()
    print("RESULT " + json.dumps(r), flush=True)
    sys.stdout.flush()
    os._exit(0)


def scenario(name, n, kind="trap_one", reserve=0, grid=1):
    wait = 5.0 if n == 1 else 11.0
    start_at = time.time() + wait
    t0 = time.time()
    ps = [subprocess.Popen([sys.executable, __file__, "child", kind, str(reserve), str(grid), str(start_at)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
          for _ in range(n)]
    res = []
    for p in ps:
        out, _ = p.communicate()
        exit_t = time.time()
        rr = [json.loads(l[7:]) for l in out.splitlines() if l.startswith("RESULT ")]
        if rr:
            rr[0]["exit_after_end"] = exit_t - rr[0]["t_end"]
            res.append(rr[0])
        else:
            res.append({"raw": out[-400:]})
    keys = ["import", "cuinit", "context", "setup", "fault", "exit_after_end"]
    def stat(k):
        v = [r[k] for r in res if isinstance(r.get(k), (int, float))]
        return f"{k} mean {sum(v)/len(v):.3f} max {max(v):.3f}" if v else f"{k} -"
    print(f"== {name} (n={n}, kind={kind}, reserve={reserve} MB, grid={grid}): wall {time.time()-t0-wait:.2f} s after the barrier")
    print("   " + "; ".join(stat(k) for k in keys))
    errs = {r.get("error") for r in res}
    print("   errors:", errs)
    for r in res:
        for k in ("raw",):
            if k in r:
                print("   ", k, r[k])
    sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        child(sys.argv[2:])
    scenario("one ok", 1, kind="ok")
    scenario("one trap", 1)
    scenario("one trap again", 1)
    scenario("one trap, 512 MB reserved", 1, reserve=512)
    scenario("one trap, big grid", 1, grid=4096)
    scenario("7 traps at once", 7)
    scenario("7 traps at once, 512 MB", 7, reserve=512)
