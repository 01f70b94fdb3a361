"""`python -m kt`: the same tool as the kt-moe command (kt._cli)."""
import sys

from ._cli import main

sys.exit(main())
