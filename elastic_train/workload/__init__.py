"""What is trained: the registry of models, datasets and losses (by name or import string), the
built-in ones and their data.
"""
