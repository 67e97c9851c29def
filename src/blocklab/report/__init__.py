"""Sweep directory -> tables, plots and a self-contained HTML report."""
