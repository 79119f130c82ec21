"""The top layer: the ``aiserve`` command line, the suite runner and the chat client.

It may import everything below it (``services``, ``aiserve``); nothing below imports it
(``tests/unit/test_layers.py`` holds this).
"""
