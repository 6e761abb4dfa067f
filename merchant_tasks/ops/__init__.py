"""What operators run: the ``merchant-tasks`` command line, status, metrics and the demo.

The top layer: may import every other folder.
"""
