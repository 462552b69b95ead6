"""Measurements taken to decide something: which grammar library to ship, whether a refactor kept the engine's
speed (two commits side by side)."""
