"""Localisation: capture, provenance, launch records, the search, replay, repro emission, report."""
