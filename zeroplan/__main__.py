"""`python -m zeroplan`: the same command line as the `zeroplan` script."""

from zeroplan.cli import main

main()
