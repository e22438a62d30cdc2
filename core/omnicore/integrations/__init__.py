"""Adapters for plugins built on other libraries (diffusers ...); each imports its library lazily."""
