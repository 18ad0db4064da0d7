"""`python -m autotune` is the `autotune` command."""

from autotune.cli.main import main

main()
