"""`python -m hetserve`: the same as the `hetserve` command."""
import sys

from hetserve.cli import main

sys.exit(main())
