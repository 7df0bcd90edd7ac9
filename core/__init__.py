"""Base pieces every layer may use (errors, atomic file writes); imports nothing else of tic."""
