import sys

from offload_bench.cli import main

sys.exit(main())
