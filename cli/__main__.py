"""`python -m omlx_jobs.cli`: the console script, for environments without it on PATH (tests, containers)."""

from omlx_jobs.cli.app import main

main()
