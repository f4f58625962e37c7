"""`python -m harness._serve {serve|worker|probe}`: the processes the harness starts for
itself (the fork server, a worker under a sanitizer, the device probe); see
`harness.workers.entry`."""

import sys

from harness import workers

sys.exit(workers.entry(sys.argv[1:]))
