"""``python -m layertap`` = the ``layertap`` console script."""

from layertap.cli import main

main()
