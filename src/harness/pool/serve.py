"""`python -m harness.pool.serve {serve|worker|probe}`: the processes the harness starts for
itself (the pool's server, a worker under a sanitizer, the device probe)."""

import sys


def main(argv: list[str]) -> int:
    """The harness's own processes: `python -m harness.pool.serve {serve|worker|probe}` (a module
    of its own, so `-m` never runs a second copy of this one, which the package has already
    imported: the plugin reads `harness.pool.channel.ROLE`, which a second copy would not share)."""
    command = argv[0] if argv else ""
    if command == "serve":
        from harness.pool.server import serve_main

        return serve_main(argv[1:])
    if command == "worker":
        from harness.pool.worker import worker_main

        return worker_main(argv[1:])
    if command == "probe":
        from harness.pool.server import probe_main

        return probe_main()
    print("usage: python -m harness.pool.serve {serve|worker|probe} (started by the harness plugin)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
