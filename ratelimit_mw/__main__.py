"""``python -m ratelimit_mw``: the ``ratelimit-mw`` command line."""

import sys

from ratelimit_mw.cli import main

sys.exit(main())
