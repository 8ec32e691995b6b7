"""Shared data: deterministic generators and loaders used by more than one method.

Method-specific data (e.g. belief-filter's HMMs) stays in the method's folder; what two
methods need lives here once.
"""
