"""Packfeed client: PackStream for trainers (arrives with issue [2/4])."""
