"""``python -m napkin.cli``: the command line."""
from napkin.cli import main

raise SystemExit(main())
