"""Packfeed reference trainer (arrives with issue [3/4])."""
