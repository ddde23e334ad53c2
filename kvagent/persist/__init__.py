"""Durable slot state (issue 17): the SQLite store (sans-Trio) and the Trio writer task that feeds it."""
