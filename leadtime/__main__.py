"""`python -m leadtime` runs the CLI."""

from leadtime.cli import main

main()
