"""``python -m kvfabric.cli``."""

import sys

from kvfabric.cli.main import main

sys.exit(main())
