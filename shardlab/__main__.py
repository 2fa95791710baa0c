"""``python -m shardlab COMMAND ...`` (and ``torchrun ... -m shardlab train ...``): the ``shardlab``
command line (cli.py)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
