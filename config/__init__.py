"""The tic.yaml schema: what a user may configure, validated strictly before anything runs."""
