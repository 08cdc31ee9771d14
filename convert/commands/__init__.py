"""The CLI's verbs beyond build: accept, generate, gate, inspect, compile, demo (``convert/cli.py`` calls them)."""
