"""``python -m kvshm.demo``: the same as ``kvshm demo``."""

import sys

from kvshm.demo.driver import main

sys.exit(main())
