"""The replay with each request's accepted drafts drawn from its own position (common random numbers for every
column: the same request at the same token accepts the same number of drafts whatever else the step holds), instead
of one stream consumed in step order (`DraftSampler.per_position`). A diagnostic of the replay's noise under
speculative decoding, run as `python per_position.py replay ...` with the replay's own arguments; nothing else
changes."""
import sys

from offload_bench.sim.drafts import DraftSampler

DraftSampler.per_position = True
from offload_bench.cli import main  # noqa: E402

main(sys.argv[1:])
