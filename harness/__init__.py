"""Engines, model cutting, capture, localisation, repro emission, metrics and kernels."""
