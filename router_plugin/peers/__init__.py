"""Routers a user could pick instead of Leadtime, re-implemented from their projects' documentation."""
