"""`python -m packfeed.cli`: the `packfeed` command."""

from packfeed.cli import entry

entry()
