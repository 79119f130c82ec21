"""``python -m suite ...``: the ``aiserve`` command without the installed console script."""

from suite.cli import main

main()
