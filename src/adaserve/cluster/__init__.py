"""Serving across replicas: the torch-free routing (``routing``) shared by the
simulator at cluster scale and the Ray Serve deployment."""
