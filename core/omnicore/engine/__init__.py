"""The runtime: requests, pipeline protocol, scheduler, runner and the Python API."""
