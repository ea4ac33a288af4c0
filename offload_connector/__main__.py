import sys

from offload_connector.cli import main

sys.exit(main())
