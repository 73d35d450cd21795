"""Reporting: tables, machine-readable exports, statistics, plots and the leaderboard,
rendered from results files only."""
