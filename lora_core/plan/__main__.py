"""``python -m lora_core.plan ...``: the ``lora-plan`` console command (``lora_core.plan.cli``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
