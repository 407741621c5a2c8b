"""`python -m packfeed.server.cli`: the `packfeed` command."""

from packfeed.server.cli import entry

entry()
