"""The ``tierkv`` command line: ``size``, ``serve`` and ``bench``."""
