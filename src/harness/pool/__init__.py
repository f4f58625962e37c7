"""Warm, supervised processes for GPU gates.

The pytest process never runs a GPU gate itself and never blocks on the device. It owns a
*pool*:

- a **server**: a fresh Python (`python -m harness.pool.serve serve`) that imports numpy, CuPy
  and the harness, collects the gate modules it is given, and never initialises CUDA. It
  forks children on request, so a child starts in milliseconds with everything imported
  and every gate collected;
- **workers**: the server's forked children. Each makes its own CUDA context on its own
  device, says hello, then runs the gates it is sent, one at a time, and sends back
  pytest's own reports. The pool keeps spares warm (context made, probe done) one ahead
  of need: a trap gate takes a spare and the spare is thrown away after it, so an
  isolated gate costs its own run time, not a Python start;
- a **watchdog**: the pytest process waits for each gate's reply with the gate's deadline.
  A worker that does not answer in time is killed (SIGKILL: a thread blocked in a CUDA
  call cannot be interrupted any other way) and the next gate gets a spare.

Under `--sanitize` the workers are not forked: each is a fresh process started under
compute-sanitizer that collects the modules itself (`python -m harness.pool.serve worker`).

Every process talks over one Unix socket the pytest process listens on, in length-prefixed
JSON frames; the first frame of each connection says who it is (server, probe or worker,
with the token the pool gave it).

The modules, by role:

- `channel`: the wire (length-prefixed JSON frames over the pool's Unix socket), the pool's
  timeline (HARNESS_POOL_TRACE), and which end of it this process is;
- `controller`: the pytest side: the pool, its workers as the pytest process sees them, the
  watchdog; `exits` counts killed workers until they are gone; `fork` starts the server as a
  fork of the pytest process where that is safe;
- `server`: the server process: collect once, fork workers on request;
- `worker`: a worker process: make a context, run gates and mutants' gate sets, reset between
  mutants;
- `lanes`: the ordinary GPU gates of a run split over several workers at once, and what
  each gate took the last time it ran (`GateTimes`);
- `ledger` and `share`: the machine's ledger of the lanes every harness run on it holds, and
  how many a run gets beside them (the host's cores, the GPU's memory) and why;
- `traps`: trap gates started ahead on spares, a few at a time (`--harness-real-traps`).
"""
