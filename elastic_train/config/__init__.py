"""The job configuration.

``job`` holds the frozen dataclasses, ``load`` builds one from TOML and
overrides, ``args`` parses ``main.py``'s command line.
"""
