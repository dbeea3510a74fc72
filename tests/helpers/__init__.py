"""Harnesses and stand-ins shared by the test modules (test modules never import each other)."""
