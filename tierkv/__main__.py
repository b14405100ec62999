"""``python -m tierkv`` is the ``tierkv`` command."""

import sys

from tierkv.cli.main import main

sys.exit(main())
