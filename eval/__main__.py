"""``python -m eval``: the ``lora-eval`` command line."""

import sys

from .cli import main

sys.exit(main())
