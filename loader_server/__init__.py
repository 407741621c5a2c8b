"""Packfeed loader server: dataset index, balancing planner, statistics, serving (torch-free)."""

__version__ = "0.1.0"
